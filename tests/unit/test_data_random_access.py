"""Random-access datasets in one process: the permutations, plans equal to element-by-element
iteration, global_shuffle's semantics, TensorFlow names, bfloat16, and a resume late in a huge
dataset that costs about one batch."""

import os

import ml_dtypes
import numpy as np
import pytest

import mpistrat as ms
from mpistrat import nest
from mpistrat.data import Dataset
from mpistrat.data.mpiio import runs_of
from mpistrat.data.permutation import IndexPermutation, ShuffleBuffer, buffer_shuffle_order


def values(ds):
    return [nest.map_structure(lambda x: np.asarray(x).tolist(), e) for e in ds]


def sequential(ds):
    """The same elements computed element by element (a filter removes random access)."""
    return ds.filter(lambda *x: True)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 65, 1000, 4097])
def test_index_permutation_is_a_bijection_and_seekable(n):
    perm = IndexPermutation(n, key=12345)
    full = perm(np.arange(n))
    assert sorted(full.tolist()) == list(range(n))
    picks = np.array([n - 1, 0, n // 2])
    assert perm(picks).tolist() == full[picks].tolist()        # any position on its own
    if n > 16:
        assert full.tolist() != list(range(n))
        assert IndexPermutation(n, key=54321)(np.arange(n)).tolist() != full.tolist()
    assert IndexPermutation(n, key=12345)(np.arange(n)).tolist() == full.tolist()
    with pytest.raises(IndexError):
        perm(np.array([n]))


def test_huge_permutation_positions_cost_nothing_to_find():
    perm = IndexPermutation(1 << 50, key=7)
    positions = np.arange((1 << 49), (1 << 49) + 256)
    out = perm(positions)
    assert len(set(out.tolist())) == 256 and out.min() >= 0 and out.max() < (1 << 50)


@pytest.mark.parametrize("n,buffer", [(10, 4), (100, 7), (5, 10), (1, 3), (37, 37), (300, 1),
                                      (300, 2), (1000, 999)])
def test_buffer_order_on_indices_is_the_buffer_on_elements(n, buffer):
    order = buffer_shuffle_order(n, buffer, key=99)
    assert order.tolist() == list(ShuffleBuffer(buffer, 99).shuffle(range(n)))
    assert sorted(order.tolist()) == list(range(n))


def test_buffer_keeps_its_locality():
    # a buffer of 10 cannot move an element more than 10 places earlier
    order = buffer_shuffle_order(1000, 10, key=3)
    assert all(order[k] <= k + 10 for k in range(1000))


def test_runs_of_sorted_rows():
    starts, lengths = runs_of(np.array([0, 1, 2, 5, 7, 8]))
    assert starts.tolist() == [0, 5, 7] and lengths.tolist() == [3, 1, 2]
    assert [a.size for a in runs_of(np.array([], np.int64))] == [0, 0]


PIPELINES = {
    "map": lambda d: d.map(lambda x: x * 3),
    "map-vectorized": lambda d: d.map(lambda x: x * 3, vectorized=True),
    "map-parallel": lambda d: d.map(lambda x: x + 1, num_parallel_calls=ms.data.AUTOTUNE),
    "zip-enumerate": lambda d: Dataset.zip((d, d.map(lambda x: -x))).enumerate(5),
    "take-skip-shard": lambda d: d.skip(3).shard(4, 1).take(9),
    "repeat-shuffle": lambda d: d.shuffle(7, seed=2).repeat(3),
    "global-repeat": lambda d: d.global_shuffle(seed=4).repeat(2),
    "batch-map": lambda d: d.batch(6).map(lambda x: x.sum(), vectorized=False),
    "batch-rowwise": lambda d: d.global_shuffle(seed=1).batch(5, drop_remainder=True)
                                .map(lambda x: x * 2, vectorized=True),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_plans_give_what_element_by_element_iteration_gives(name):
    build = PIPELINES[name]
    fast = build(Dataset.range(50))
    shuffled = "global" in name or "rowwise" in name   # needs random access below it
    slow = None if shuffled else build(sequential(Dataset.range(50)))
    assert fast._node.blocker() is None
    got = values(fast)
    if slow is not None:
        assert got == values(slow)
    assert fast.cardinality() == len(got)


def test_global_shuffle_semantics():
    ds = Dataset.range(200).global_shuffle(seed=11)
    first, second = values(ds), values(ds)
    assert sorted(first) == list(range(200)) and first != list(range(200))
    assert first != second                                   # a new order each epoch
    assert values(Dataset.range(200).global_shuffle(seed=11)) == first  # same seed, same order
    fixed = Dataset.range(200).global_shuffle(seed=11, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    unseeded = Dataset.range(200).global_shuffle()
    assert sorted(values(unseeded)) == list(range(200))
    with pytest.raises(ValueError, match="random access.*filter"):
        Dataset.range(10).filter(lambda x: x > 2).global_shuffle(seed=0)
    with pytest.raises(ValueError, match="finite"):
        Dataset.range(10).repeat().global_shuffle(seed=0)


def test_repeat_after_shuffles_reshuffles_every_repetition():
    ds = Dataset.range(20).global_shuffle(seed=5).repeat(3)
    reps = np.array(values(ds)).reshape(3, 20)
    assert all(sorted(r) == list(range(20)) for r in reps.tolist())
    assert len({tuple(r) for r in reps.tolist()}) == 3


def test_cardinality_and_len():
    assert Dataset.range(10).batch(3).cardinality() == 4
    assert Dataset.range(10).batch(3, drop_remainder=True).cardinality() == 3
    assert Dataset.range(10).repeat().cardinality() == ms.data.INFINITE_CARDINALITY
    assert Dataset.range(10).filter(lambda x: True).cardinality() == ms.data.UNKNOWN_CARDINALITY
    assert len(Dataset.range(10).shard(3, 2)) == 3
    assert values(Dataset.range(10).repeat().take(12)) == list(range(10)) + [0, 1]


def test_as_numpy_iterator_and_element_spec_do_not_advance_epochs():
    ds = Dataset.from_tensor_slices({"x": np.arange(6.0), "y": np.arange(6)}).global_shuffle(seed=3)
    spec = ds.batch(4).element_spec
    assert spec["x"].shape == (None,) and spec["y"].dtype == np.int64
    first = list(Dataset.range(3).as_numpy_iterator())
    assert first == [0, 1, 2] and isinstance(first[0], np.int64)
    once = [e["y"] for e in ds.as_numpy_iterator()]
    again = Dataset.from_tensor_slices({"x": np.arange(6.0), "y": np.arange(6)}).global_shuffle(seed=3)
    _ = again.element_spec                                   # reading the spec starts no epoch
    assert [e["y"] for e in again.as_numpy_iterator()] == once


def test_bfloat16_stays_bfloat16(tmp_path):
    values16 = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16)
    ds = Dataset.from_tensor_slices(values16).global_shuffle(seed=0).map(lambda x: x * 2).batch(5)
    batches = list(ds)
    assert all(b.dtype == ml_dtypes.bfloat16 for b in batches)
    assert sorted(np.concatenate(batches).astype(np.float32).tolist()) == \
        [2.0 * i for i in range(12)]
    path = tmp_path / "b.bin"
    values16.tofile(path)
    reader = ms.data.FixedLengthRecordDataset([str(path)], 2, dtype=ml_dtypes.bfloat16)
    got = np.concatenate(list(reader.batch(5)))
    assert got.dtype == ml_dtypes.bfloat16 and got.view(np.uint16).tolist() == \
        values16.view(np.uint16).tolist()
    assert ds.element_spec.dtype == ml_dtypes.bfloat16


def test_a_reader_reads_only_the_rows_asked_for(tmp_path):
    path = tmp_path / "r.bin"
    np.arange(1000, dtype=np.int32).tofile(path)
    reader = ms.data.FixedLengthRecordDataset([str(path)], 4, dtype=np.int32)
    rows = reader.gather_rows(np.array([900, 3, 4, 5, 3, 17]))
    assert rows.tolist() == [900, 3, 4, 5, 3, 17]
    assert reader.bytes_read == 5 * 4                        # 3 read once
    taken = values(reader.global_shuffle(seed=1).take(10))
    assert reader.bytes_read == 5 * 4 + 10 * 4


def _write_sparse(path, records, record_bytes):
    with open(path, "wb") as handle:                          # a sparse file: no disk used
        handle.truncate(records * record_bytes)


def test_resuming_late_in_a_huge_dataset_costs_about_one_batch(tmp_path):
    """A reader over 64 GiB (sparse) and a range of 2**40 rows, globally shuffled: the first
    batch after restoring at step 2**31 reads what the first batch of epoch 0 reads (no
    replay of the steps before it). Work is counted, not timed: this machine is noisy."""
    path = str(tmp_path / "huge.bin")
    _write_sparse(path, 1 << 24, 4096)                        # 16 M records of 4 KiB
    strategy = ms.MultiWorkerMirroredStrategy()

    def first_batch_bytes(step):
        reader = ms.data.FixedLengthRecordDataset([path], 4096)
        labels = Dataset.range(1 << 40).global_shuffle(seed=2)
        rows = Dataset.zip((reader.global_shuffle(seed=1).repeat(), labels))
        iterator = iter(strategy.experimental_distribute_dataset(
            rows.map(lambda x, y: (x[:, :8].astype(np.float32), y), vectorized=True).batch(256)))
        if step:
            # the state as checkpoints saved before the pipeline fingerprint hold it: still
            # consumed whole (the fingerprint's keys are optional)
            state = {"epoch": np.array(3), "steps": np.array(step), "seed": np.array(0),
                     "replicas": np.array(1), "policy": np.array(2)}
            ckpt_dir = tmp_path / f"at-{step}"
            ms.Checkpoint(iterator=state).write(str(ckpt_dir / "pos"))
            ms.Checkpoint(iterator=iterator).read(str(ckpt_dir / "pos")).assert_consumed()
        batch = next(iterator)
        assert batch[0].values[0].shape == (256, 8)
        return reader.bytes_read

    fresh = first_batch_bytes(0)
    late = first_batch_bytes((1 << 31) + 17)
    assert 0 < late <= fresh, (fresh, late)
