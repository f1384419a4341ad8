"""TFRecord files and tf.train.Example without TensorFlow, in one process: records and parsed
features as TensorFlow 2.21 reported them (tests/data/tf), the pure-Python fallbacks (run in
a child process where protobuf and google-crc32c cannot be imported), hostile records."""

import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import DataLossError, InvalidArgumentError
from mpistrat.tfformats.crc import masked_crc32c
from mpistrat.tfformats.record_index import index_path, load_index
from mpistrat.tfformats.records import frame, scan_offsets

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())
RECORD_FILES = sorted(k for k in REPORT if k.startswith("records/"))
FEATURES = {"x": ms.io.FixedLenFeature([3], "float32"),
            "label": ms.io.FixedLenFeature([], np.int64),
            "name": ms.io.FixedLenFeature([], "string"),
            "tags": ms.io.VarLenFeature("int64"),
            "weights": ms.io.VarLenFeature(np.float32),
            "blobs": ms.io.VarLenFeature(bytes)}


def encoded(value) -> dict:
    value = np.asarray(value)
    if value.dtype == object:
        return {"shape": list(value.shape), "strings": [bytes(v).hex() for v in value.reshape(-1)]}
    return {"shape": list(value.shape), "hex": value.tobytes().hex()}


def parsed_as_report(parsed: dict) -> dict:
    out = {}
    for name, value in parsed.items():
        if isinstance(value, ms.io.SparseTensorValue):
            out[name] = {"values": encoded(value.values), "indices": value.indices.tolist(),
                         "dense_shape": value.dense_shape.tolist()}
        else:
            out[name] = encoded(value)
    return out


@pytest.fixture
def records(tmp_path):
    """A copy of the record fixtures (the tests write index caches beside them)."""
    shutil.copytree(DATA / "records", tmp_path / "records")
    return tmp_path / "records"


@pytest.mark.parametrize("name", RECORD_FILES)
def test_records_and_features_are_what_tensorflow_read(records, name):
    info = REPORT[name]
    dataset = ms.data.TFRecordDataset(str(records / os.path.basename(name)),
                                      info["compression"])
    got = list(dataset)
    assert [r.hex() for r in got] == info["records"]
    for record, want in zip(got, info["parsed"]):
        if want is not None:
            assert parsed_as_report(ms.io.parse_single_example(record, FEATURES)) == want
    examples = [r for r in got if r]
    batch = ms.io.parse_example(np.array(examples, dtype=object), FEATURES)
    for row, record in enumerate(examples):
        one = ms.io.parse_single_example(record, FEATURES)
        assert batch["x"][row].tobytes() == one["x"].tobytes()
        assert batch["name"][row] == one["name"][()]
        mine = batch["tags"].indices[:, 0] == row
        assert batch["tags"].values[mine].tolist() == one["tags"].values.tolist()
        assert batch["tags"].indices[mine, 1].tolist() == one["tags"].indices[:, 0].tolist()
    assert batch["blobs"].dense_shape.tolist() == [len(examples), max(
        len(ms.io.parse_single_example(r, FEATURES)["blobs"].values) for r in examples)]


def test_batches_and_random_reads_agree(records):
    files = sorted(str(p) for p in records.glob("plain-*.tfrecord"))
    everything = [bytes(r) for r in ms.data.TFRecordDataset(files)]
    batches = list(ms.data.TFRecordDataset(files).batch(4))
    assert [r for b in batches for r in b] == everything and len(batches[0]) == 4
    reader = ms.data.TFRecordDataset(files)
    assert reader.num_rows == len(everything)
    for start, stop in [(0, 1), (3, 11), (5, 5), (0, len(everything))]:
        assert list(reader.read_rows(start, stop)) == everything[start:stop]
    assert os.path.exists(index_path(files[0], None))  # cached in the user's cache directory
    assert not [p for p in os.listdir(records) if "index" in p]   # nothing beside the data
    assert sum(reader.counts[i] for i in range(len(files))) == len(everything)


def test_the_index_is_rebuilt_when_the_file_changes(records, tmp_path):
    path = str(records / "plain-0.tfrecord")
    cache_dir = str(tmp_path / "indexes")
    first = ms.data.TFRecordDataset(path, index_dir=cache_dir)
    assert first.num_rows == 8 and os.listdir(cache_dir)
    again = ms.data.TFRecordDataset(path, index_dir=cache_dir)
    assert again.num_rows == 8 and again.index_bytes_read > 0     # read from the cache
    with open(path, "ab") as handle:
        handle.write(frame(b"one more"))
    changed = ms.data.TFRecordDataset(path, index_dir=cache_dir)
    assert changed.num_rows == 9 and list(changed.read_rows(8, 9)) == [b"one more"]
    cache = index_path(path, cache_dir)
    data = bytearray(open(cache, "rb").read())
    data[-10] ^= 0xFF                                            # a damaged cache is not used
    open(cache, "wb").write(bytes(data))
    assert load_index(path, None, cache_dir) is None
    assert ms.data.TFRecordDataset(path, index_dir=cache_dir).num_rows == 9
    data = bytearray(open(cache, "rb").read())
    data[24 + 32:24 + 40] = (2 ** 60).to_bytes(8, "little")     # a count the cache cannot hold
    open(cache, "wb").write(bytes(data))
    assert load_index(path, None, cache_dir) is None


def test_a_cache_inconsistent_with_an_intact_file_is_rebuilt(tmp_path):
    """A cache made for another file of the same size and modification time (copied data, a
    restored backup) passed every check and its offsets were trusted: the intact file was
    then refused as corrupt. The record headers at the cached offsets are now checked."""
    a, b = str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")
    open(a, "wb").write(frame(b"x" * 10) + frame(b"y" * 10))      # records end at 26, 52
    open(b, "wb").write(frame(b"z" * 4) + frame(b"w" * 16))       # at 20, 52: same size
    cache_dir = str(tmp_path / "indexes")
    assert ms.data.TFRecordDataset(a, index_dir=cache_dir).num_rows == 2
    info = os.stat(a)
    os.utime(b, ns=(info.st_atime_ns, info.st_mtime_ns))
    shutil.copyfile(index_path(a, cache_dir), index_path(b, cache_dir))
    assert load_index(b, None, cache_dir) is None
    dataset = ms.data.TFRecordDataset(b, index_dir=cache_dir)
    assert [bytes(r) for r in dataset.read_rows(0, 2)] == [b"z" * 4, b"w" * 16]
    assert load_index(b, None, cache_dir).tolist() == [0, 20, 52]   # rebuilt and saved


def test_compressed_files_read_in_one_pass_and_by_range(records):
    path = str(records / "gzip-0.tfrecord.gz")
    everything = [bytes(r) for r in ms.data.TFRecordDataset(path, "GZIP")]
    reader = ms.data.TFRecordDataset(path, "gzip", buffer_size=64)
    assert list(reader.read_rows(1, 3)) == everything[1:3]
    assert list(reader.read_rows(3, 5)) == everything[3:5]      # continues the stream
    assert list(reader.read_rows(0, 2)) == everything[0:2]      # starts again
    with pytest.raises(DataLossError, match="gzip-0.tfrecord.gz.*ZLIB stream is corrupt"):
        list(ms.data.TFRecordDataset(path, "ZLIB"))              # not a zlib stream


@pytest.mark.parametrize("defect, text", [
    ("length_crc", "CRC-32C of its length"),
    ("data_crc", "CRC-32C of its data"),
    ("truncated", "truncated record"),
    ("huge_length", "truncated record"),
])
def test_hostile_records(tmp_path, defect, text):
    good = frame(b"first") + frame(b"second record")
    data = bytearray(good)
    offset = len(frame(b"first"))
    if defect == "length_crc":
        data[offset + 9] ^= 1
    elif defect == "data_crc":
        data[offset + 14] ^= 1
    elif defect == "truncated":
        data = data[:-3]
    else:  # 2 GiB claimed, the length's own CRC right
        length = (2 ** 31).to_bytes(8, "little")
        data[offset:offset + 12] = length + struct.pack("<I", masked_crc32c(length))
    path = str(tmp_path / "bad.tfrecord")
    open(path, "wb").write(bytes(data))
    attempts = [lambda: list(ms.data.TFRecordDataset(path)),
                lambda: ms.data.TFRecordDataset(path).read_rows(0, 2)]
    if defect != "data_crc":  # the index checks lengths; data CRCs are checked as read
        attempts += [lambda: ms.data.TFRecordDataset(path).num_rows, lambda: scan_offsets(path)]
    for attempt in attempts:
        with pytest.raises(DataLossError, match=text) as info:
            attempt()
        assert path in str(info.value) and f"offset {offset}" in str(info.value)
    gz = str(tmp_path / "bad.tfrecord.gz")
    open(gz, "wb").write(gzip.compress(bytes(data)))
    with pytest.raises(DataLossError, match=text):
        list(ms.data.TFRecordDataset(gz, "GZIP"))


@pytest.mark.parametrize("field", ["length", "data"])
def test_the_first_corrupt_record_of_many_is_named(tmp_path, field):
    frames = [frame(b"record %d" % i * (i % 7)) for i in range(300)]
    offset = sum(len(f) for f in frames[:150])
    data = bytearray(b"".join(frames))
    data[offset + (3 if field == "length" else len(frames[150]) - 1)] ^= 0x80
    data[offset + len(frames[150]) + 13] ^= 0x80          # a later one is corrupt too
    path = str(tmp_path / "many.tfrecord")
    open(path, "wb").write(bytes(data))
    text = "CRC-32C of its length" if field == "length" else "CRC-32C of its data"
    with pytest.raises(DataLossError, match=f"offset {offset}: the {text}"):
        list(ms.data.TFRecordDataset(path))
    with pytest.raises(DataLossError, match=f"offset {offset}: the"):
        ms.data.TFRecordDataset(path).read_rows(0, 300) if field == "data" else \
            ms.data.TFRecordDataset(path).num_rows


def test_a_truncated_gzip_stream(tmp_path):
    path = str(tmp_path / "cut.gz")
    data = gzip.compress(frame(b"a" * 1000) * 20)
    open(path, "wb").write(data[:len(data) // 2])
    with pytest.raises(DataLossError, match="cut.gz"):
        list(ms.data.TFRecordDataset(path, "GZIP"))


def test_writer_matches_tensorflows_framing(records, tmp_path):
    info = REPORT["records/plain-0.tfrecord"]
    for compression in (None, "GZIP", "ZLIB"):
        path = str(tmp_path / f"ours-{compression}")
        with ms.io.TFRecordWriter(path, compression) as writer:
            for record in info["records"]:
                writer.write(bytes.fromhex(record))
        if compression is None:
            assert open(path, "rb").read() == (records / "plain-0.tfrecord").read_bytes()
        else:
            raw = open(path, "rb").read()
            plain = gzip.decompress(raw) if compression == "GZIP" else zlib.decompress(raw)
            assert plain == (records / "plain-0.tfrecord").read_bytes()


def test_example_errors_name_the_feature():
    data = ms.io.serialize_example({"x": [1.0, 2.0], "n": [3]})
    with pytest.raises(InvalidArgumentError, match="Feature: missing"):
        ms.io.parse_single_example(data, {"missing": ms.io.FixedLenFeature([], "float32")})
    with pytest.raises(InvalidArgumentError, match="Key: x.*Values size: 2"):
        ms.io.parse_single_example(data, {"x": ms.io.FixedLenFeature([3], "float32")})
    with pytest.raises(InvalidArgumentError, match="Key: n.  Data types don't match"):
        ms.io.parse_single_example(data, {"n": ms.io.FixedLenFeature([], "float32")})
    with pytest.raises(InvalidArgumentError, match="Could not parse"):
        ms.io.parse_example([data, b"\x0a\xff"], {"n": ms.io.VarLenFeature("int64")})
    with pytest.raises(InvalidArgumentError, match="float32, int64 or string"):
        ms.io.parse_single_example(data, {"n": ms.io.FixedLenFeature([], "float64")})
    defaulted = ms.io.parse_single_example(data, {
        "w": ms.io.FixedLenFeature([2, 2], "int64", default_value=[1, 2, 3, 4]),
        "s": ms.io.FixedLenFeature([2], "string", default_value=[b"?", b"?"]),
        "v": ms.io.VarLenFeature("float32")})
    assert defaulted["w"].tolist() == [[1, 2], [3, 4]]
    assert defaulted["s"].tolist() == [b"?", b"?"]
    with pytest.raises(InvalidArgumentError, match="'s': default_value"):   # TensorFlow
        ms.io.parse_single_example(data, {                                  # reshapes it
            "s": ms.io.FixedLenFeature([2], "string", default_value=b"?")})  # (no broadcast)
    assert defaulted["v"].values.shape == (0,) and defaulted["v"].dense_shape.tolist() == [0]


def test_defaults_as_tensorflow_takes_them_and_bad_ones_refused_up_front():
    """A str default crashed with TypeError only once a record lacked the feature (a job died
    mid-epoch; TensorFlow gives b"unknown"); a default of the wrong size was a bare broadcast
    error. Both now: the value as TensorFlow gives it, or an error naming the feature before
    any record is parsed."""
    has, lacks = ms.io.serialize_example({"label": [b"cat"]}), ms.io.serialize_example({"n": [1]})
    spec = {"label": ms.io.FixedLenFeature([], "string", default_value="unknown"),
            "pair": ms.io.FixedLenFeature([2], "string", default_value=["é", b"b"])}
    got = ms.io.parse_example([has, lacks], spec)
    assert got["label"].tolist() == [b"cat", b"unknown"]
    assert got["pair"].tolist() == [["é".encode(), b"b"]] * 2
    for feature, words in [(ms.io.FixedLenFeature([3], "float32", default_value=[1.0, 2.0]),
                            r"'x': default_value of shape \[2\].*shape \[3\]"),
                           (ms.io.FixedLenFeature([], "string", default_value=5),
                            "'x': default_value 5 is not strings"),
                           (ms.io.FixedLenFeature([], "int64", default_value="many"),
                            "'x': default_value 'many' is not int64")]:
        with pytest.raises(InvalidArgumentError, match=words):
            ms.io.parse_example([has], {"x": feature})   # (the record has no 'x' at all)


def test_float_lists_with_extra_fields_parse_element_by_element():
    from mpistrat.tfformats.wire import varint
    floats = np.array([1.5, -2.0], "<f4").tobytes()
    float_list = b"\x0a" + varint(8) + floats + b"\x10\x07"      # an unknown field 2 after
    feature = b"\x12" + varint(len(float_list)) + float_list
    entry = b"\x0a\x01x" + b"\x12" + varint(len(feature)) + feature
    features = b"\x0a" + varint(len(entry)) + entry
    example = b"\x0a" + varint(len(features)) + features
    got = ms.io.parse_single_example(example, {"x": ms.io.FixedLenFeature([2], "float32")})
    assert got["x"].tolist() == [1.5, -2.0]


def test_dtypes_are_accepted_in_every_spelling():
    data = ms.io.serialize_example({"x": [1.5], "n": [2], "b": [b"z"]})
    for f, n, b in [("float32", "int64", "string"), (np.float32, np.int64, bytes),
                    (np.dtype("float32"), np.dtype("int64"), object)]:
        got = ms.io.parse_single_example(data, {"x": ms.io.FixedLenFeature([], f),
                                                "n": ms.io.FixedLenFeature([], n),
                                                "b": ms.io.FixedLenFeature([], b)})
        assert (float(got["x"]), int(got["n"]), got["b"][()]) == (1.5, 2, b"z")


_FALLBACK = r"""
import sys, json
sys.modules["google.protobuf"] = None     # the packages are missing here
sys.modules["google_crc32c"] = None
import numpy as np, mpistrat as ms
from mpistrat.tfformats import crc, messages
assert messages.backend() == "python" and crc.implementation() == "python"
from tests.unit.test_tf_records import FEATURES, REPORT, parsed_as_report, DATA
from tests.unit.test_tf_checkpoint_files import CHECKPOINTS, REPORT as TENSORS, _bytes_of
checked = 0
for name in sorted(k for k in REPORT if k.startswith("records/")):
    info = REPORT[name]
    records = list(ms.data.TFRecordDataset(str(DATA / name), info["compression"],
                                           index_dir=sys.argv[1]))
    assert [r.hex() for r in records] == info["records"], name
    for record, want in zip(records, info["parsed"]):
        if want is not None:
            assert parsed_as_report(ms.io.parse_single_example(record, FEATURES)) == want
            checked += 1
for name in CHECKPOINTS:
    reader = ms.train.load_checkpoint(str(DATA / name))
    for key, want in TENSORS[name].items():
        assert _bytes_of(reader.get_tensor(key), want), key
        checked += 1
print(checked)
"""


def test_pure_python_fallbacks_read_the_same(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result = subprocess.run([sys.executable, "-c", _FALLBACK, str(tmp_path)], cwd=root, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) > 100


def test_a_distributed_read_ahead_window_holds_its_bytes_whatever_the_records_weigh(tmp_path):
    """The read-ahead window of a distributed TFRecordDataset is READ_AHEAD_BYTES of records:
    each record's weight is the indexed files' mean (it was 1 byte, so a window was always
    16,384 steps: every record of a large dataset read into memory at once)."""
    from mpistrat.data import layouts
    path = str(tmp_path / "sizes.tfrecord")
    with ms.io.TFRecordWriter(path) as writer:
        for size in (10, 20, 30000):
            writer.write(b"x" * size)
    dataset = ms.data.TFRecordDataset([path], index_dir=str(tmp_path / "index"))
    assert dataset._node.row_bytes == 1                     # nothing indexed yet
    assert dataset.num_rows == 3
    assert dataset._node.row_bytes == -(-(10 + 20 + 30000 + 3 * 16) // 3)   # framing: 16 each
    steps = layouts.read_ahead_steps(dataset._node.row_bytes, 256, 1)
    assert steps * 256 * dataset._node.row_bytes <= layouts.READ_AHEAD_BYTES
