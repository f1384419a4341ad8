"""Pure functions: partition, fusion and layout math, tested without MPI traffic."""

import collections

import numpy as np
import pytest

from mpistrat import nest
from mpistrat.cluster_resolver import expand_hostlist, expand_tasks_per_node
from mpistrat.collectives.algorithms import choose_algorithm, ring_chunks
from mpistrat.collectives.fusion import plan_buckets
from mpistrat.collectives.validation import describe_mismatch, format_ranks
from mpistrat.runtime.abort import tag_lines
from mpistrat.runtime.world import node_layout


@pytest.mark.parametrize("count,parts", [(0, 1), (10, 3), (3, 4), (7, 7), (1000, 4)])
def test_ring_chunks_cover_the_buffer_contiguously(count, parts):
    chunks = ring_chunks(count, parts)
    assert len(chunks) == parts
    assert chunks[0][0] == 0 and chunks[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    sizes = [b - a for a, b in chunks]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_ring_chunks_rejects_nonsense():
    with pytest.raises(ValueError):
        ring_chunks(5, 0)


def test_choose_algorithm_by_size_and_ranks():
    assert choose_algorithm(100, 2, threshold=1000) == "mpi"
    assert choose_algorithm(1000, 2, threshold=1000) == "ring"
    assert choose_algorithm(10**9, 1, threshold=1000) == "mpi"
    assert choose_algorithm(10**9, 4, threshold=-1) == "mpi"


def test_plan_buckets_fuses_small_tensors_by_dtype_in_order():
    plan = plan_buckets([8, 8, 64, 8, 8], ["f4", "i4", "f4", "f4", "i4"], 32)
    assert [(b.dtype, b.indices, b.fused) for b in plan] == [
        ("f4", (0, 3), True), ("i4", (1, 4), True), ("f4", (2,), False)]


def test_plan_buckets_closes_a_full_bucket():
    plan = plan_buckets([10] * 7, ["f4"] * 7, 30)
    assert [b.indices for b in plan] == [(0, 1, 2), (3, 4, 5), (6,)]
    covered = sorted(i for b in plan for i in b.indices)
    assert covered == list(range(7))


def test_plan_buckets_validates_arguments():
    with pytest.raises(ValueError):
        plan_buckets([1], ["f4", "f4"], 8)
    with pytest.raises(ValueError):
        plan_buckets([1], ["f4"], 0)


def test_describe_mismatch_names_ranks_and_shapes():
    text = describe_mismatch("all_reduce SUM", [
        (("float32", (3,)), ("int32", (2,))),
        (("float32", (3,)), ("int32", (2,))),
        (("float32", (3,)), ("int64", (2,)))])
    assert "tensor 1" in text
    assert "ranks 0, 1 have int32[2]" in text
    assert "rank 2 has int64[2]" in text


def test_describe_mismatch_of_tensor_counts():
    text = describe_mismatch("x", [(("f", (1,)),), ()])
    assert "number of tensors" in text and "rank 1 passes 0 tensors" in text
    assert format_ranks([3]) == "rank 3" and format_ranks([0, 2]) == "ranks 0, 2"


@pytest.mark.parametrize("size,per_node", [(1, 1), (4, 2), (5, 2), (3, 4)])
def test_node_layout_partitions_the_ranks(size, per_node):
    layouts = [node_layout(r, size, per_node) for r in range(size)]
    assert {l.num_nodes for l in layouts} == {-(-size // per_node)}
    for node in range(layouts[0].num_nodes):
        members = [l for l in layouts if l.node_index == node]
        assert sorted(l.local_rank for l in members) == list(range(len(members)))
        assert {l.local_size for l in members} == {len(members)}


def test_node_layout_rejects_bad_input():
    with pytest.raises(ValueError):
        node_layout(0, 2, 0)
    with pytest.raises(ValueError):
        node_layout(2, 2, 1)


def test_hostlist_expansion():
    assert expand_hostlist("gpu[01-03,7],login") == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        expand_tasks_per_node("two")


def test_tag_lines():
    assert tag_lines("a\nb", "[r1]") == "[r1] a\n[r1] b"


Point = collections.namedtuple("Point", "x y")


def test_nest_round_trip_keeps_structure_and_sorted_dict_order():
    structure = {"b": [1, (2, 3)], "a": Point(4, {"z": 5, "y": 6})}
    leaves = nest.flatten(structure)
    assert leaves == [4, 6, 5, 1, 2, 3]
    rebuilt = nest.pack_sequence_as(structure, [x * 10 for x in leaves])
    assert rebuilt == {"a": Point(40, {"y": 60, "z": 50}), "b": [10, (20, 30)]}
    assert isinstance(rebuilt["a"], Point)
    with pytest.raises(ValueError):
        nest.pack_sequence_as([1, 2], [1])
    with pytest.raises(ValueError):
        nest.pack_sequence_as([1], [1, 2])
    assert nest.map_structure(lambda a, b: a + b, [1, {"k": 2}], [3, {"k": 4}]) == [4, {"k": 6}]
    arr = np.ones(3)
    assert nest.flatten(arr)[0] is arr
