"""Partitioned (sliced) variables in TensorFlow's files (tests/data/tf/sliced/, written by
TensorFlow 2.21: MaxShardSizePolicy and a TF1 fixed_size_partitioner): every tensor is what
TensorFlow reassembled, bit for bit; slice keys decode; crafted indexes (a slice missing, two
overlapping, one outside the shape, a garbled key) are refused naming the variable."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import DataLossError
from mpistrat.tfformats import bundle, messages, sstable
from mpistrat.tfformats.slices import decode_slice_key, is_slice_key, tile_check

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())
SLICED = ["sliced/policy/ckpt", "sliced/tf1/model.ckpt"]


def _table(prefix):
    path = str(prefix) + ".index"
    return sstable.read_table(open(path, "rb").read(), path)


@pytest.mark.parametrize("name", SLICED)
def test_every_sliced_tensor_is_what_tensorflow_reassembled(name):
    slice_keys = [k for k, _ in _table(DATA / name) if is_slice_key(k)]
    assert len(slice_keys) >= 4, "the fixture must hold slices for this test to mean anything"
    reader = ms.train.load_checkpoint(str(DATA / name))
    want = REPORT[name]
    assert reader.get_variable_to_shape_map() == {k: v["shape"] for k, v in want.items()}
    for key, expected in want.items():
        value = np.asarray(reader.get_tensor(key), dtype=None if key != "_CHECKPOINTABLE_"
                           "OBJECT_GRAPH" else object)
        dtype = reader.get_variable_to_dtype_map()[key].name
        assert {"object": "string"}.get(dtype, dtype) == expected["dtype"], key
        assert list(value.shape) == expected["shape"], key
        if "strings" in expected:        # the object graph
            assert [bytes(v).hex() for v in np.asarray(value).reshape(-1)] == expected["strings"]
        else:
            assert np.ascontiguousarray(value).tobytes().hex() == expected["hex"], key
    names = {decode_slice_key(k)[0] for k in slice_keys}
    assert names <= set(want) and len(names) >= 2


def _rewrite(prefix, change):
    """Copy the fixture's files next to ``prefix`` and rewrite its index through ``change``
    (rows of (key bytes, value bytes) -> rows)."""
    rows = change(_table(DATA / SLICED[1]))
    data = sstable.build_table(rows)
    Path(str(prefix) + ".index").write_bytes(data)


@pytest.fixture
def copy(tmp_path):
    source = DATA / "sliced" / "tf1"
    for path in source.iterdir():
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / "model.ckpt"


def _emb_slices(rows):
    return [(k, v) for k, v in rows if is_slice_key(k) and decode_slice_key(k)[0] == "part/emb"]


def test_a_missing_slice_is_named(copy):
    drop = _emb_slices(_table(copy))[1][0]
    _rewrite(copy, lambda rows: [(k, v) for k, v in rows if k != drop])
    with pytest.raises(DataLossError, match=r"'part/emb'.*slice \[.*\] is listed but its entry "
                                            r"is missing"):
        bundle.read_index(str(copy))


def _with_extents(rows, name, change):
    out = []
    for key, value in rows:
        if key == name.encode():
            proto = messages.parse("BundleEntryProto", value, "test")
            fields = {"dtype": proto.dtype, "shape": {"dim": [{"size": d.size}
                                                             for d in proto.shape.dim]},
                      "slices": change([[{"start": e.start, "length": e.length}
                                         if e.WhichOneof("has_length") else {}
                                         for e in s.extent] for s in proto.slices])}
            value = messages.serialize("BundleEntryProto", fields)
        out.append((key, value))
    return out


def test_slices_listed_twice_or_missing_from_the_list_are_refused(copy):
    _rewrite(copy, lambda rows: _with_extents(rows, "part/emb",
                                              lambda s: [{"extent": e} for e in s + s[:1]]))
    with pytest.raises(DataLossError, match=r"'part/emb': its slices cover \d+ of its 70"):
        bundle.read_index(str(copy))
    _rewrite(copy, lambda rows: _with_extents(rows, "part/emb",
                                              lambda s: [{"extent": e} for e in s[1:]]))
    with pytest.raises(DataLossError, match=r"its slices cover \d+ of its 70 elements"):
        bundle.read_index(str(copy))


def test_a_garbled_slice_key_is_refused(copy):
    key = _emb_slices(_table(copy))[0][0]
    _rewrite(copy, lambda rows: sorted([(k[:-1] + b"\x07" if k == key else k, v)
                                        for k, v in rows]))
    with pytest.raises(DataLossError, match="invalid slice key|is listed but its entry"):
        bundle.read_index(str(copy))


def test_the_tiling_rule():
    tile_check((4, 3), [((0, 0), (4, 1)), ((0, 1), (4, 3))], "v")
    with pytest.raises(DataLossError, match="outside the shape"):
        tile_check((4, 3), [((0, 0), (5, 3))], "v")
    with pytest.raises(DataLossError, match="overlaps another"):   # (the counts add up)
        tile_check((4, 3), [((0, 0), (3, 3)), ((2, 0), (3, 3))], "v")
    with pytest.raises(DataLossError, match="cover 9 of its 12"):
        tile_check((4, 3), [((0, 0), (3, 3))], "v")


def test_convert_writes_the_reassembled_tensors(tmp_path):
    import subprocess
    import sys

    import h5py
    done = subprocess.run([sys.executable, "-m", "mpistrat", "convert", str(DATA / SLICED[1]),
                           str(tmp_path / "ckpt-1")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with h5py.File(tmp_path / "ckpt-1.h5", "r") as handle:    # plain h5py, no mpistrat
        for key, expected in REPORT[SLICED[1]].items():
            value = handle[key][()]
            assert np.ascontiguousarray(value).tobytes().hex() == expected["hex"], key


def test_zero_size_and_crafted_many_slices_are_refused_quickly():
    import time
    with pytest.raises(DataLossError, match="outside the shape"):
        tile_check((0, 4), [((0, 100), (0, 102))], "v")
    tile_check((0, 4), [((0, 0), (0, 4))], "v")                 # an empty tensor, one slice
    # slices along the second axis sharing their first span: linear, not pairwise
    n = 4000
    slices = [((0, k), (2, k + 1)) for k in range(n)]
    start = time.monotonic()
    tile_check((2, n), slices, "v")
    with pytest.raises(DataLossError, match="overlaps another"):
        tile_check((2, n), slices[:-1] + [((0, 0), (2, 1))], "v")
    assert time.monotonic() - start < 5.0
