"""TensorFlow checkpoints read without TensorFlow: every tensor bit for bit as TensorFlow 2.21
reported it (tests/data/tf, written by tests/data/make_tf_fixtures.py), the table and bundle
writers byte-compatible with TensorFlow's, the object graph's paths."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import NotFoundError
from mpistrat.tfformats import bundle, bundle_writer, messages, object_graph, sstable, wire
from mpistrat.tfformats.crc import _python_extend, crc32c, mask, masked_crc32c, unmask

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())
CHECKPOINTS = ["module/ckpt-1", "module/ckpt-2", "module_sharded/ckpt", "keras/ckpt-1",
               "written/weights", "slots/ckpt"]
_TF_NAMES = {"object": "string"}


def _bytes_of(value: np.ndarray, want: dict) -> bool:
    if "strings" in want:
        return [bytes(v).hex() for v in np.asarray(value, dtype=object).reshape(-1)] == \
            want["strings"]
    return np.ascontiguousarray(value).tobytes().hex() == want["hex"]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_every_tensor_is_what_tensorflow_read(name):
    reader = ms.train.load_checkpoint(str(DATA / name))
    want = REPORT[name]
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    assert sorted(shapes) == sorted(want)
    for key, expected in want.items():
        assert shapes[key] == expected["shape"], key
        assert _TF_NAMES.get(dtypes[key].name, dtypes[key].name) == expected["dtype"], key
        value = reader.get_tensor(key)
        assert list(np.shape(value)) == expected["shape"], key
        assert _bytes_of(value, expected), key
        assert reader.has_tensor(key)
    assert not reader.has_tensor("no/such/key")
    with pytest.raises(NotFoundError, match="no/such/key"):
        reader.get_tensor("no/such/key")


def test_every_dtype_is_covered():
    dtypes = {e["dtype"] for e in REPORT["module/ckpt-1"].values()}
    assert dtypes >= {"float32", "float64", "float16", "bfloat16", "bool", "int8", "uint8",
                      "int32", "int64", "complex64", "string"}
    assert REPORT["module/ckpt-1"]["model/empty/.ATTRIBUTES/VARIABLE_VALUE"]["shape"] == [0, 3]


def test_a_directory_means_its_latest_checkpoint():
    latest = ms.train.load_checkpoint(str(DATA / "module"))
    assert latest.prefix.endswith("ckpt-2")
    assert ms.train.list_variables(str(DATA / "module")) == sorted(
        (k, v["shape"]) for k, v in REPORT["module/ckpt-2"].items())
    by_index = ms.train.load_checkpoint(str(DATA / "module" / "ckpt-1.index"))
    assert by_index.prefix.endswith("ckpt-1")
    assert ms.train.latest_checkpoint(str(DATA / "module")).endswith("ckpt-2")


def test_write_leaves_no_state_file_so_the_directory_has_no_latest():
    with pytest.raises(NotFoundError, match="state"):
        ms.train.load_checkpoint(str(DATA / "written"))
    with pytest.raises(NotFoundError, match="nothing.index"):
        ms.train.load_checkpoint(str(DATA / "written" / "nothing"))
    assert ms.train.load_checkpoint(str(DATA / "written" / "weights")).has_tensor(
        "extra/.ATTRIBUTES/VARIABLE_VALUE")


def _graph(name):
    index = bundle.read_index(str(DATA / name))
    return object_graph.parse_graph(bundle.read_value(index.entries[object_graph.GRAPH_KEY])[()],
                                    name)


def test_object_graph_paths_follow_tensorflow_keys():
    for name in CHECKPOINTS:
        for value in _graph(name).values:
            assert value.key == f"{value.path}/.ATTRIBUTES/{value.name}", (name, value)


def test_a_keras_kernel_is_found_by_either_path():
    graph = _graph("keras/ckpt-1")
    canonical = graph.find("optimizer/_trainable_variables/0")
    assert canonical.key == "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
    assert graph.find("model/_functional/_operations/1/_kernel") == canonical
    assert canonical.full_name == "sequential/dense/kernel"
    assert graph.find("model/_functional/_operations/1/nothing") is None
    assert graph.find("model") is None  # a node without a value of its own


def test_legacy_optimizer_slots_sit_under_their_variable():
    graph = _graph("slots/ckpt")
    assert graph.find("model/w/.OPTIMIZER_SLOT/optimizer/m").key == \
        "model/w/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"


def test_our_value_encoding_is_tensorflows_byte_for_byte():
    for name in CHECKPOINTS:
        index = bundle.read_index(str(DATA / name))
        for key, entry in index.entries.items():
            value = bundle.read_value(entry)
            enum, shape, data, crc = bundle_writer.encode_value(value)
            with open(entry.file, "rb") as handle:
                handle.seek(entry.offset)
                stored = handle.read(entry.size)
            assert (enum, tuple(shape), data, crc) == (entry.enum, entry.shape, stored,
                                                       entry.crc), (name, key)


def test_tables_round_trip_through_our_writer():
    for name in CHECKPOINTS:
        path = str(DATA / name) + ".index"
        entries = sstable.read_table(open(path, "rb").read(), path)
        assert sstable.read_table(sstable.build_table(entries), "rebuilt") == entries
    rng = np.random.default_rng(3)
    keys = sorted({bytes(rng.integers(97, 100, size=rng.integers(0, 12)).astype(np.uint8))
                   for _ in range(2000)})
    entries = [(k, bytes(rng.integers(0, 256, size=rng.integers(0, 300)).astype(np.uint8)))
               for k in keys]
    for compression in (None, "snappy"):
        for interval in (1, 3, 16):
            data = sstable.build_table(entries, compression, block_size=700,
                                       restart_interval=interval)
            assert sstable.read_table(data, "made") == entries


def test_bundle_writer_round_trip_every_dtype(tmp_path):
    import ml_dtypes
    values = {
        "a/float": np.linspace(-1, 1, 7, dtype=np.float32).reshape(7, 1),
        "a/half": np.array([1.5, -2.25], np.float16),
        "a/bf16": np.array([1.5, -3.0, 1e10], ml_dtypes.bfloat16),
        "a/f8": np.array([0.5, -1.0], ml_dtypes.float8_e4m3fn),
        "b/bool": np.array([[True], [False]]),
        "b/u64": np.array([2 ** 64 - 1], np.uint64),
        "b/c128": np.array([1 - 1j]),
        "b/empty": np.zeros((3, 0), np.int16),
        "c/strings": np.array([b"", b"x" * 300, "\u00e9".encode()], dtype=object),
        "c/empty_strings": np.zeros((0,), dtype=object),
        "c/scalar_string": np.array(b"one", dtype=object),
    }
    prefix = str(tmp_path / "ckpt-1")
    items = sorted(values.items())
    first = bundle_writer.write_shard(bundle.data_name(prefix, 0, 2), items[:5], 0)
    second = bundle_writer.write_shard(bundle.data_name(prefix, 1, 2), items[5:], 1)
    bundle_writer.write_index(prefix, 2, second + first)
    reader = ms.train.load_checkpoint(prefix)
    assert sorted(reader.get_variable_to_shape_map()) == sorted(values)
    for key, value in values.items():
        got = reader.get_tensor(key)
        if value.dtype == object:  # strings: bytes objects (a scalar is bytes, as in TF)
            got = np.array(got, dtype=object) if value.shape == () else got
            assert got.shape == value.shape and list(got.reshape(-1)) == \
                list(value.reshape(-1)), key
        else:
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert got.tobytes() == value.tobytes(), key
    assert reader.get_tensor("c/scalar_string") == b"one"


def test_messages_parse_alike_with_protobuf_and_the_wire_reader():
    assert messages.backend() == "protobuf"
    for name in CHECKPOINTS:
        path = str(DATA / name) + ".index"
        for key, value in sstable.read_table(open(path, "rb").read(), path)[1:]:
            ours = wire.decode(messages.SCHEMA, "BundleEntryProto", value)
            theirs = messages.parse("BundleEntryProto", value, key)
            for field in ("dtype", "shard_id", "offset", "size", "crc32c"):
                assert getattr(ours, field) == getattr(theirs, field), (key, field)
            assert [d.size for d in ours.shape.dim] == [d.size for d in theirs.shape.dim]
            fields = {"dtype": ours.dtype, "shape": {"dim": [{"size": d.size} for d in
                                                             ours.shape.dim]},
                      "shard_id": ours.shard_id, "offset": ours.offset, "size": ours.size,
                      "crc32c": ours.crc32c}
            assert wire.encode(messages.SCHEMA, "BundleEntryProto", fields) == \
                messages.serialize("BundleEntryProto", fields) == value, key
    data = bundle.read_value(bundle.read_index(str(DATA / "keras/ckpt-1")).entries[
        object_graph.GRAPH_KEY])[()]
    ours = wire.decode(messages.SCHEMA, "TrackableObjectGraph", data)
    theirs = messages.parse("TrackableObjectGraph", data, "graph")
    assert [[(c.node_id, c.local_name) for c in n.children] for n in ours.nodes] == \
        [[(c.node_id, c.local_name) for c in n.children] for n in theirs.nodes]
    assert [n.has_checkpoint_values.value for n in ours.nodes] == \
        [n.has_checkpoint_values.value for n in theirs.nodes]


def test_crc32c_and_its_mask():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    rng = np.random.default_rng(1)
    for size in (0, 1, 7, 8, 9, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert _python_extend(0, np.frombuffer(data, np.uint8)) == crc32c(data)
        assert unmask(mask(crc32c(data))) == crc32c(data)
    assert masked_crc32c(b"\x00" * 8) == mask(crc32c(b"\x00" * 8)) != crc32c(b"\x00" * 8)


def test_one_of_ours_is_named_as_such(tmp_path):
    path = ms.Checkpoint(w=ms.Variable(np.zeros(2))).write(str(tmp_path / "ours"))
    with pytest.raises(NotFoundError, match="one of ours"):
        ms.train.load_checkpoint(path)


def test_a_missing_shard_is_named(tmp_path):
    shutil.copytree(DATA / "module_sharded", tmp_path / "m")
    os.remove(tmp_path / "m" / "ckpt.data-00001-of-00002")
    with pytest.raises(NotFoundError, match="ckpt.data-00001-of-00002"):
        ms.train.load_checkpoint(str(tmp_path / "m" / "ckpt"))
