"""Hostile TensorFlow checkpoints: each crafted defect is a DataLossError naming the file
(and the key, where there is one), raised before anything large is allocated.

The crafted files start as copies of real TensorFlow fixtures; tables are rebuilt with our
writer or, for defects it refuses to write (keys out of order), assembled block by block.
"""

import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import DataLossError, InvalidArgumentError
from mpistrat.tfformats import bundle, bundle_writer, messages, object_graph, sstable, wire
from mpistrat.tfformats.crc import masked_crc32c

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
KEY = "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture
def prefix(tmp_path):
    shutil.copytree(DATA / "module", tmp_path / "m")
    return str(tmp_path / "m" / "ckpt-1")


def entries_of(prefix):
    path = prefix + ".index"
    return sstable.read_table(open(path, "rb").read(), path)


def fields_of(value: bytes) -> dict:
    proto = wire.decode(messages.SCHEMA, "BundleEntryProto", value)
    return {"dtype": proto.dtype, "shape": {"dim": [{"size": d.size} for d in proto.shape.dim]},
            "shard_id": proto.shard_id, "offset": proto.offset, "size": proto.size,
            "crc32c": proto.crc32c}


def set_entry(prefix, key, **changes):
    rows = []
    for name, value in entries_of(prefix):
        if name == key.encode():
            fields = fields_of(value)
            fields.update(changes)
            value = messages.serialize("BundleEntryProto", fields)
        rows.append((name, value))
    write_index_rows(prefix, rows)


def write_index_rows(prefix, rows):
    with open(prefix + ".index", "wb") as handle:
        handle.write(sstable.build_table(rows))


def raw_table(block: bytes) -> bytes:
    """A table of one data block holding ``block`` as it is (no checks on its entries)."""
    def trailer(contents):
        return contents + b"\0" + struct.pack("<I", masked_crc32c(contents + b"\0"))
    out = trailer(block)
    meta_at, meta = len(out), sstable._block_bytes([], 16)
    out += trailer(meta)
    index_at = len(out)
    handle = wire.varint(0) + wire.varint(len(block))
    index = sstable._block_bytes([(b"\xff", handle)], 1)
    out += trailer(index)
    footer = (wire.varint(meta_at) + wire.varint(len(meta)) + wire.varint(index_at) +
              wire.varint(len(index))).ljust(40, b"\0") + struct.pack("<Q", sstable.MAGIC)
    return out + footer


def refused(prefix, *match):
    with pytest.raises(DataLossError) as info:
        ms.train.load_checkpoint(prefix).get_tensor(KEY)
    for text in match:
        assert text in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("keep", [0, 30, 47, -1, -8, -48])
def test_a_truncated_index(prefix, keep):
    data = open(prefix + ".index", "rb").read()
    open(prefix + ".index", "wb").write(data[:keep] if keep >= 0 else data[:len(data) + keep])
    refused(prefix, "ckpt-1.index")


def test_wrong_magic(prefix):
    data = bytearray(open(prefix + ".index", "rb").read())
    data[-1] ^= 0xFF
    open(prefix + ".index", "wb").write(bytes(data))
    refused(prefix, "ckpt-1.index", "magic")


def test_a_block_crc_mismatch(prefix):
    data = bytearray(open(prefix + ".index", "rb").read())
    data[20] ^= 0x01
    open(prefix + ".index", "wb").write(bytes(data))
    refused(prefix, "ckpt-1.index", "CRC-32C")


def test_an_offset_beyond_the_shard(prefix):
    size = os.path.getsize(prefix + ".data-00000-of-00001")
    set_entry(prefix, KEY, offset=size - 8)
    refused(prefix, "ckpt-1.index", KEY, "beyond the end")


def test_a_2gib_size_claimed_by_a_small_file(prefix):
    set_entry(prefix, KEY, shape={"dim": [{"size": 1 << 29}]}, size=1 << 31)
    tracemalloc.start()
    try:
        refused(prefix, KEY, "beyond the end")
        assert tracemalloc.get_traced_memory()[1] < 16 << 20  # nothing large was allocated
    finally:
        tracemalloc.stop()


def test_a_size_that_does_not_fit_the_shape(prefix):
    set_entry(prefix, KEY, shape={"dim": [{"size": 3}, {"size": 5}]})
    refused(prefix, KEY, "needs")


def test_a_shape_no_array_can_have_is_named(prefix):
    set_entry(prefix, KEY, shape={"dim": [{"size": 1 << 62}, {"size": 1 << 62}]}, size=0)
    with pytest.raises(DataLossError, match="too large for any array") as info:
        ms.train.load_checkpoint(prefix)
    assert KEY in str(info.value) and "ckpt-1.index" in str(info.value)


def test_a_shape_of_no_element_numpy_cannot_make_is_listed_then_named(prefix):
    """[0, 2**62] float32 holds no value and needs no byte, yet NumPy cannot make it:
    TensorFlow 2.21 lists it and its get_tensor raises NumPy's ValueError (before: a bare
    'array is too big' with nothing named, then a DataLossError refusing the whole index)."""
    set_entry(prefix, KEY, shape={"dim": [{"size": 0}, {"size": 1 << 62}]}, size=0,
              crc32c=masked_crc32c(b""))
    assert dict(ms.train.list_variables(prefix))[KEY] == [0, 1 << 62]
    with pytest.raises(InvalidArgumentError, match="NumPy cannot hold an array of shape") as info:
        ms.train.load_checkpoint(prefix).get_tensor(KEY)
    assert KEY in str(info.value) and "ckpt-1.data-00000-of-00001" in str(info.value)


def test_entries_that_all_point_at_one_block_are_refused_before_any_read(prefix):
    """A crafted index of many entries pointing at one block made a restore read it once per
    entry (200,000 entries over 1 MiB: over an hour); the claims are checked against the
    shard's size first."""
    rows = dict(entries_of(prefix))
    target = rows[KEY.encode()]
    for k in range(2000):
        rows[f"copy/{k:05d}/.ATTRIBUTES/VARIABLE_VALUE".encode()] = target
    write_index_rows(prefix, sorted(rows.items()))
    with pytest.raises(DataLossError, match="overlap") as info:
        ms.train.load_checkpoint(prefix)
    assert "ckpt-1.index" in str(info.value) and "claim" in str(info.value)


def test_a_graph_chain_too_deep_to_spell_is_refused_small():
    """An 80,000-node chain: every first path spelled out is gigabytes (a bare MemoryError
    before); now a DataLossError naming the file, with little memory used."""
    nodes = [{"children": [{"node_id": k + 1, "local_name": "n"}]} for k in range(79_999)]
    data = messages.serialize("TrackableObjectGraph", {"nodes": nodes + [{}]})
    tracemalloc.start()
    try:
        with pytest.raises(DataLossError, match="crafted graph: the object graph nests deeper"):
            object_graph.parse_graph(data, "crafted graph")
        assert tracemalloc.get_traced_memory()[1] < 256 << 20
    finally:
        tracemalloc.stop()


def test_bad_varints_in_an_entry(prefix):
    rows = [(k, b"\x08" + b"\xff" * 11 if k == KEY.encode() else v) for k, v in
            entries_of(prefix)]
    write_index_rows(prefix, rows)
    refused(prefix, KEY, "not a valid BundleEntryProto")


def test_bad_varints_in_a_block(prefix):
    block = b"\x00\xff\xff\xff\xff\xff\xff" + struct.pack("<II", 0, 1)
    open(prefix + ".index", "wb").write(raw_table(block))
    refused(prefix, "ckpt-1.index", "bad entry")


def test_keys_out_of_order(prefix):
    rows = entries_of(prefix)
    shuffled = [rows[0], rows[3], rows[2]] + rows[4:]
    open(prefix + ".index", "wb").write(raw_table(sstable._block_bytes(shuffled, 16)))
    message = refused(prefix, "ckpt-1.index", "out of order")
    assert rows[2][0].decode() in message  # the key that came too late


def test_shared_key_bytes_at_a_restart_point(prefix):
    good = sstable._block_bytes([(b"", b"x"), (b"ab", b"y")], 16)
    bad = bytearray(good)
    bad[0] = 1  # the first entry claims to share a byte with a key before it
    open(prefix + ".index", "wb").write(raw_table(bytes(bad)))
    refused(prefix, "ckpt-1.index", "bad entry")


def test_a_crc_mismatch_in_the_data(prefix):
    entry = bundle.read_index(prefix).entries[KEY]
    data = bytearray(open(entry.file, "rb").read())
    data[entry.offset + 3] ^= 0x10
    open(entry.file, "wb").write(bytes(data))
    refused(prefix, "ckpt-1.data-00000-of-00001", KEY, "CRC-32C mismatch")


def test_a_truncated_data_shard(prefix):
    path = prefix + ".data-00000-of-00001"
    os.truncate(path, os.path.getsize(path) // 2)
    refused(prefix, "data-00000-of-00001", "beyond the end")


def test_corrupt_string_lengths(prefix):
    key = "model/words/.ATTRIBUTES/VARIABLE_VALUE"
    entry = bundle.read_index(prefix).entries[key]
    data = bytearray(open(entry.file, "rb").read())
    data[entry.offset] ^= 0x01  # the first length
    open(entry.file, "wb").write(bytes(data))
    with pytest.raises(DataLossError, match="string lengths"):
        ms.train.load_checkpoint(prefix).get_tensor(key)


@pytest.mark.parametrize("changes, error, text", [
    ({"dtype": 99}, DataLossError, "unknown TensorFlow dtype 99"),
    ({"shape": {"dim": [{"size": -3}]}}, DataLossError, "invalid shape"),
    ({"shard_id": 5}, DataLossError, "shard 5"),
    ({"offset": -1}, DataLossError, "negative offset"),
])
def test_entries_that_make_no_sense(prefix, changes, error, text):
    set_entry(prefix, KEY, **changes)
    with pytest.raises(error, match=text) as info:
        ms.train.load_checkpoint(prefix)
    assert KEY in str(info.value) and "ckpt-1.index" in str(info.value)


def test_an_entry_of_a_dtype_we_cannot_hold_is_listed_and_refused_when_read(prefix):
    set_entry(prefix, KEY, dtype=21)               # variant: a tf.data iterator's state
    reader = ms.train.load_checkpoint(prefix)      # (the others stay readable)
    assert reader.get_variable_to_dtype_map()[KEY] == "variant"
    with pytest.raises(InvalidArgumentError, match="variant") as info:
        reader.get_tensor(KEY)
    assert KEY in str(info.value)


def test_a_missing_header(prefix):
    write_index_rows(prefix, entries_of(prefix)[1:])
    refused(prefix, "header")


def test_a_graph_naming_nodes_that_do_not_exist():
    data = messages.serialize("TrackableObjectGraph", {"nodes": [
        {"children": [{"node_id": 7, "local_name": "model"}]}]})
    with pytest.raises(DataLossError, match="child node 7"):
        object_graph.parse_graph(data, "crafted graph")


def test_an_index_that_is_a_fifo_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "ckpt-1.index")
    with pytest.raises(DataLossError, match="not a regular file"):
        bundle.read_index(str(tmp_path / "ckpt-1"))
    with pytest.raises(ms.errors.NotFoundError):  # not a checkpoint at all
        ms.train.load_checkpoint(str(tmp_path / "ckpt-1"))


def test_a_crafted_slice_list_is_refused_naming_the_key(prefix):
    rows = []
    for name, value in entries_of(prefix):
        if name == KEY.encode():
            fields = fields_of(value)
            fields["slices"] = [{"extent": [{"start": 0, "length": 1}]}]
            value = messages.serialize("BundleEntryProto", fields)
        rows.append((name, value))
    write_index_rows(prefix, rows)
    with pytest.raises(DataLossError, match=rf"key '{KEY}': a slice of rank 1 for a tensor of "
                                            rf"rank 2"):
        ms.train.load_checkpoint(prefix)


def test_the_pure_python_wire_reader_refuses_alike():
    for data in (b"\x08" + b"\xff" * 11, b"\x12\x05ab", b"\x0b", b"\x00\x01"):
        with pytest.raises(wire.WireError):
            wire.decode(messages.SCHEMA, "BundleEntryProto", data)
        with pytest.raises(DataLossError):
            messages.parse("BundleEntryProto", data, "crafted")
    assert np.array_equal(wire.decode(messages.SCHEMA, "FloatList", b"\x0a\x04\x00\x00\x80\x3f")
                          .value, [1.0])


def _colliding_checkpoint(prefix):
    """A TF2 checkpoint whose root has a child named 'a/b' (key a.Sb/...) and a child 'a'
    with a child 'b' (key a/b/...): both are object path 'a/b' here."""
    def value(key):
        return {"name": "VARIABLE_VALUE", "checkpoint_key": key, "full_name": ""}
    one, two = "a.Sb/.ATTRIBUTES/VARIABLE_VALUE", "a/b/.ATTRIBUTES/VARIABLE_VALUE"
    graph = messages.serialize("TrackableObjectGraph", {"nodes": [
        {"children": [{"node_id": 1, "local_name": "a/b"}, {"node_id": 2, "local_name": "a"}]},
        {"attributes": [value(one)]},
        {"children": [{"node_id": 3, "local_name": "b"}]},
        {"attributes": [value(two)]}]})
    items = sorted([(one, np.ones(2, np.float32)), (two, np.zeros(2, np.float32)),
                    (object_graph.GRAPH_KEY, np.array(graph, dtype=object))],
                   key=lambda kv: kv[0].encode())
    entries = bundle_writer.write_shard(bundle.data_name(prefix, 0, 1), items)
    bundle_writer.write_index(prefix, 1, entries)


def test_convert_refuses_two_tensorflow_keys_that_become_one_path(tmp_path):
    """Before, 'a.Sb' and 'a/b' converted to one value and the command exited 0."""
    from mpistrat.convert import convert
    prefix = str(tmp_path / "tf" / "ckpt-1")
    os.makedirs(os.path.dirname(prefix))
    _colliding_checkpoint(prefix)
    with pytest.raises(ValueError, match=r"become one object path here: 'a/b' from") as info:
        convert(prefix, str(tmp_path / "ours" / "ckpt-1"))
    assert "a.Sb" in str(info.value) and "nothing was written" in str(info.value)
    assert not (tmp_path / "ours" / "ckpt-1.h5").exists()


def test_a_restore_onto_a_path_two_tensorflow_keys_become_is_refused(tmp_path):
    """Before, the restore took whichever key came last, silently."""
    prefix = str(tmp_path / "tf" / "ckpt-1")
    os.makedirs(os.path.dirname(prefix))
    _colliding_checkpoint(prefix)
    target = {"b": np.full(2, 7.0, np.float32)}
    with pytest.raises(ValueError, match=r"'a/b'.*both become this object path") as info:
        ms.Checkpoint(a=target).restore(prefix)
    assert "a.Sb" in str(info.value)
    assert target["b"].tolist() == [7.0, 7.0]          # nothing was read into it


def test_convert_onto_an_existing_directory_is_refused(tmp_path, prefix):
    """Before, it wrote hidden DST/.index and DST/.data files and exited 0."""
    from mpistrat.convert import convert
    target = tmp_path / "existing"
    target.mkdir()
    for dst in (str(target), str(tmp_path / "new-dir") + os.sep):
        with pytest.raises(IsADirectoryError, match="is a directory: give a checkpoint prefix"):
            convert(prefix, dst)
    assert os.listdir(target) == []
