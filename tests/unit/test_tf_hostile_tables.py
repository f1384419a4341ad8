"""Hostile TensorFlow checkpoints, second round: index tables whose blocks repeat, overlap,
point backwards or cycle, keys whose prefix compression expands quadratically, wrong restart
arrays, object graphs of deep chains and cycles, and shapes at the edges (zero, 2**63,
negative). Each is refused with a DataLossError naming the file (or read exactly as
TensorFlow 2.21 reads it), in bounded time and memory.

What TensorFlow 2.21 did with each crafted shape (measured with tf.train.load_checkpoint on
bundles written by our writer): ``[0, 3]`` and ``[0]`` float32, ``[0]`` strings: empty
arrays; ``[0, 2**62]`` float32: listed, ``get_tensor`` a ``ValueError`` (NumPy cannot make
it); ``[-1]``, ``[-5, 2]``, ``[2**32, 2**32]``, ``[2**62, 2**62, 0]``: the process aborted
(a failed CHECK in tensor_shape.cc), which we name instead.
"""

import struct
import time
import tracemalloc

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import DataLossError, InvalidArgumentError
from mpistrat.tfformats import bundle, bundle_writer, messages, object_graph, sstable, wire
from mpistrat.tfformats.crc import crc32c, mask, masked_crc32c

HEADER = messages.serialize("BundleHeaderProto", {"num_shards": 1, "version": {"producer": 1}})


def trailer(contents: bytes) -> bytes:
    return contents + b"\0" + struct.pack("<I", masked_crc32c(contents + b"\0"))


def table(blocks, handles, index_keys=None):
    """A table of ``blocks`` (raw contents, laid out in order) whose index lists
    ``handles``: block numbers (their real offset and size) or ``(offset, size)`` pairs."""
    out, places = b"", []
    for block in blocks:
        places.append((len(out), len(block)))
        out += trailer(block)
    meta_at, meta = len(out), sstable._block_bytes([], 16)
    out += trailer(meta)
    rows = []
    for number, handle in enumerate(handles):
        offset, size = places[handle] if isinstance(handle, int) else handle
        key = index_keys[number] if index_keys else b"\xff" + number.to_bytes(4, "big")
        rows.append((key, wire.varint(offset) + wire.varint(size)))
    index = sstable._block_bytes(rows, 1)
    index_at = len(out)
    out += trailer(index)
    footer = (wire.varint(meta_at) + wire.varint(len(meta)) + wire.varint(index_at) +
              wire.varint(len(index))).ljust(40, b"\0") + struct.pack("<Q", sstable.MAGIC)
    return out + footer


def data_block(keys):
    return sstable._block_bytes([(k, b"v") for k in keys], 16)


def refused(data: bytes, *words) -> str:
    with pytest.raises(DataLossError) as info:
        sstable.read_table(data, "crafted.index")
    assert "crafted.index" in str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)
    return str(info.value)


# -- blocks that repeat, overlap, point backwards or cycle ------------------------------------
def test_a_block_listed_a_hundred_thousand_times_is_refused_at_once():
    """Before, each listing read the block again: time in proportion to a claimed count."""
    data = table([data_block([b"a", b"b"])], [0] * 100_000)
    start = time.perf_counter()
    refused(data, "listed twice")
    assert time.perf_counter() - start < 2.0


def test_blocks_that_overlap_point_backwards_or_cycle_are_refused():
    one, two = data_block([b"a", b"b"]), data_block([b"c", b"d"])
    offset_two = len(trailer(one))
    refused(table([one, two], [0, (offset_two - 3, len(two))]), "overlapping")
    refused(table([one, two], [1, 0], [b"d", b"e"]), "out of order")
    refused(table([one, two], [0, 1, 0], [b"b", b"d", b"e"]), "listed twice")
    assert sstable.read_table(table([one, two], [0, 1], [b"b", b"d"]), "good") == \
        [(b"a", b"v"), (b"b", b"v"), (b"c", b"v"), (b"d", b"v")]


def test_a_data_block_at_the_index_block_is_refused():
    block = data_block([b"a"])
    data = table([block], [0])
    meta = len(trailer(block))
    index_at = meta + len(trailer(sstable._block_bytes([], 16)))
    index_size = len(sstable._block_bytes([(b"\xff\0\0\0\0", wire.varint(0) + wire.varint(
        len(block)))], 1))
    refused(table([block], [(index_at, index_size)]), "where the index block starts")
    assert sstable.read_table(data, "good") == [(b"a", b"v")]


def test_many_empty_data_blocks_are_refused_at_the_first():
    empty = sstable._block_bytes([], 16)
    refused(table([empty] * 1000, list(range(1000))), "holds no entries")


def test_keys_that_expand_quadratically_are_refused_within_a_budget():
    """Each key the one before plus a byte: 200,000 entries in 0.8 MB expand to 20 GB of
    keys; refused once they pass 64 MiB + 16 bytes per byte of the file."""
    body = bytearray()
    count = 200_000
    body += wire.varint(0) + wire.varint(1) + wire.varint(0) + b"a"
    for k in range(1, count):
        body += wire.varint(k) + b"\x01\x00" + bytes([97 + k % 26])
    block = bytes(body) + struct.pack("<II", 0, 1)
    tracemalloc.start()
    try:
        start = time.perf_counter()
        refused(table([block], [0]), "expand past")
        assert time.perf_counter() - start < 5.0
        assert tracemalloc.get_traced_memory()[1] < (64 << 20) + 16 * len(block) + (64 << 20)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("restarts, words", [
    ([8, 0], "not increasing"),            # unsorted
    ([0, 0], "not increasing"),            # repeated
    ([5], "not increasing"),               # not at the first entry
    ([0, 7], "inside an entry"),           # in the middle of the second entry (at 5)
    ([0, 5, 100], "beyond its entries"),
])
def test_a_wrong_restart_array_is_named(restarts, words):
    entries = b"\x00\x01\x01av" + b"\x00\x01\x01bv" + b"\x00\x01\x01cv"   # 3 entries at 0, 5, 10
    block = entries + struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack(
        "<I", len(restarts))
    refused(table([block], [0]), words, "restart")


def test_a_restart_count_past_the_block_is_named():
    block = b"\x00\x01\x01av" + struct.pack("<II", 0, 10_000)
    refused(table([block], [0]), "restart points")


# -- object graphs: deep chains, cycles, long paths, bad names ------------------------------
def _node(children=(), attributes=()) -> bytes:
    body = b""
    for node_id, name in children:
        ref = b"\x08" + wire.varint(node_id) + b"\x12" + wire.varint(len(name)) + name
        body += b"\x0a" + wire.varint(len(ref)) + ref
    for key in attributes:
        item = b"\x0a\x0eVARIABLE_VALUE\x1a" + wire.varint(len(key)) + key
        body += b"\x12" + wire.varint(len(item)) + item
    return b"\x0a" + wire.varint(len(body)) + body


@pytest.mark.parametrize("depth", [100_000, 1_000_000])
def test_a_deep_chain_is_refused_at_the_limit_in_bounded_time_and_memory(depth):
    """Each node names the next as its child. Before, 10**6 nodes took over 450 MB and 4 s
    before the depth check; now the walk stops at depth 1001."""
    data = b"".join(_node([(k + 1, b"n")]) for k in range(depth - 1)) + _node(
        attributes=[b"end"])
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(DataLossError, match=r"crafted graph: the object graph nests deeper "
                                                r"than 1000 levels: node 1001 is at depth 1001"):
            object_graph.parse_graph(data, "crafted graph")
        assert time.perf_counter() - start < 5.0
        assert tracemalloc.get_traced_memory()[1] < 3 * len(data) + (16 << 20)
    finally:
        tracemalloc.stop()


def test_a_cycle_is_walked_once_and_kept_as_tensorflow_keeps_it():
    data = (_node([(1, b"a")]) + _node([(2, b"b")], [b"a/.ATTRIBUTES/VARIABLE_VALUE"]) +
            _node([(0, b"root"), (1, b"back")], [b"a/b/.ATTRIBUTES/VARIABLE_VALUE"]))
    graph = object_graph.parse_graph(data, "a cycle")
    assert [(v.path, v.key) for v in graph.values] == [
        ("a", "a/.ATTRIBUTES/VARIABLE_VALUE"), ("a/b", "a/b/.ATTRIBUTES/VARIABLE_VALUE")]
    assert graph.find("a/b/back/b/root/a").key == "a/.ATTRIBUTES/VARIABLE_VALUE"  # any alias


def test_paths_that_would_spell_gigabytes_are_refused_before_any_is_made():
    """999 nested objects of 1,000-character names, each with a value: 500 million
    characters of paths from a graph of 1 MB."""
    name = b"x" * 1000
    data = b"".join(_node([(k + 1, name)], [b"k%d" % k]) for k in range(999)) + _node()
    tracemalloc.start()
    try:
        with pytest.raises(DataLossError, match="value paths add up to over"):
            object_graph.parse_graph(data, "crafted graph")
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_a_child_name_that_is_not_utf8_is_named():
    data = _node([(1, b"caf\xe9")]) + _node(attributes=[b"k"])
    with pytest.raises(DataLossError, match="crafted graph"):
        object_graph.parse_graph(data, "crafted graph")
    with pytest.raises(DataLossError, match="is not UTF-8 text"):   # the pure-Python reader
        object_graph._walk(wire.decode(messages.SCHEMA, "TrackableObjectGraph", data).nodes, 2,
                           "crafted graph")


def test_drop_attributes_keeps_every_other_byte():
    data, keys = object_graph.build_graph({"a/x": "variable", "a/y": "variable", "b": "state"})
    assert object_graph.drop_attributes(data, set(), "g") == data
    smaller = object_graph.drop_attributes(data, {keys["a/y"]}, "g")
    before, after = object_graph.parse_graph(data, "g"), object_graph.parse_graph(smaller, "g")
    assert [v.path for v in after.values] == ["a/x", "b"] and after.children == before.children
    assert object_graph.drop_attributes(smaller, {keys["a/y"]}, "g") == smaller
    assert data.count(keys["a/y"].encode()) == 1 and keys["a/y"].encode() not in smaller


# -- shapes at the edges ------------------------------------------------------------------------
def _bundle(tmp_path, enum, dims, size=0):
    prefix = str(tmp_path / "ckpt")
    entries = bundle_writer.write_shard(bundle.data_name(prefix, 0, 1),
                                        [("ok", np.arange(3, dtype=np.float32))])
    entries.append({"key": "v", "dtype": enum, "shape": {"dim": [{"size": d} for d in dims]},
                    "shard_id": 0, "offset": 0, "size": size, "crc32c": mask(crc32c(b""))})
    bundle_writer.write_index(prefix, 1, entries)
    return prefix


@pytest.mark.parametrize("enum, dims, dtype", [
    (1, [0, 3], "float32"), (1, [0], "float32"), (6, [0, 1 << 62], "int8"),
    (7, [0], "object"), (7, [0, 3], "object"), (1, [5, 0], "float32")])
def test_a_shape_of_no_element_reads_as_tensorflow_reads_it(tmp_path, enum, dims, dtype):
    prefix = _bundle(tmp_path, enum, dims)
    assert dict(ms.train.list_variables(prefix))["v"] == dims
    value = ms.train.load_checkpoint(prefix).get_tensor("v")
    assert value.shape == tuple(dims) and value.dtype == np.dtype(dtype) and value.size == 0


@pytest.mark.parametrize("dims", [[0, 1 << 62], [0, 1 << 62, 1 << 62]])
def test_dims_numpy_cannot_hold_are_listed_and_refused_when_read(tmp_path, dims):
    """TensorFlow lists them and its get_tensor raises NumPy's ValueError."""
    prefix = _bundle(tmp_path, 1, dims)
    assert dict(ms.train.list_variables(prefix))["v"] == dims
    with pytest.raises(InvalidArgumentError, match="NumPy cannot hold") as info:
        ms.train.load_checkpoint(prefix).get_tensor("v")
    assert isinstance(info.value, ValueError)
    assert "ckpt.data-00000-of-00001" in str(info.value) and "'v'" in str(info.value)


@pytest.mark.parametrize("dims, words", [
    ([-1], "a negative dimension"), ([-5, 2], "a negative dimension"),
    ([1 << 32, 1 << 32], "multiply past 2\\*\\*63"),
    ([1 << 62, 1 << 62, 0], "multiply past 2\\*\\*63"),     # (the zero comes too late)
    ([(1 << 63) - 1, 2], "multiply past 2\\*\\*63")])
def test_shapes_tensorflow_aborts_on_are_named(tmp_path, dims, words):
    prefix = _bundle(tmp_path, 1, dims)
    with pytest.raises(DataLossError, match=words) as info:
        ms.train.load_checkpoint(prefix)
    assert "ckpt.index" in str(info.value) and "'v'" in str(info.value)


def test_attributes_that_claim_each_others_keys_are_refused_in_bounded_work():
    """A crafted graph whose 1,000 attributes all name one prefix of 1,000 keys would pair
    every attribute with every key (10^6 paths); a key claimed twice is refused at once, and
    keys that are not TensorFlow's attribute form (an empty checkpoint_key) claim nothing."""
    import time
    from mpistrat.errors import DataLossError
    from mpistrat.tfformats.object_graph import GraphValue, ObjectGraph, attribute_keys
    keys = [f"a/.ATTRIBUTES/{i:04d}" for i in range(1000)]
    shared = ObjectGraph({}, [GraphValue(n, f"x{n}", "a/.ATTRIBUTES/0", f"x{n}")
                              for n in range(1000)])
    start = time.perf_counter()
    with pytest.raises(DataLossError, match="two attributes"):
        attribute_keys(shared, keys, "crafted.index")
    empty = ObjectGraph({}, [GraphValue(n, f"x{n}", "", f"x{n}") for n in range(1000)])
    assert attribute_keys(empty, keys, "crafted.index") == [[]] * 1000
    assert time.perf_counter() - start < 1.0
