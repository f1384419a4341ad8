"""The batch Example parser (NumPy over the wire bytes) against the record-by-record path
(TensorFlow's rules, fast_parsing.py): the same arrays bit for bit, the same errors, for
canonical encodings and for the unusual ones it must leave to that path. TensorFlow's own
parse of its own files is checked in test_tf_records.py (through both paths), and of every
kind of byte string in test_parse_oracle.py."""

import struct

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.io import example as ex
from mpistrat.io.example_batch import parse_batch
from mpistrat.tfformats.wire import varint

FEATURES = {
    "x": ms.io.FixedLenFeature([3], "float32"),
    "label": ms.io.FixedLenFeature([], "int64", default_value=-1),
    "name": ms.io.FixedLenFeature([], "string", default_value="none"),
    "tags": ms.io.VarLenFeature("int64"),
    "weights": ms.io.VarLenFeature("float32"),
    "blobs": ms.io.VarLenFeature("string"),
    "grid": ms.io.FixedLenFeature([2, 2], "int64", default_value=[[1, 2], [3, 4]]),
    "a_name_longer_than_8": ms.io.VarLenFeature("string"),
}


def random_example(rng) -> bytes:
    """An Example with some of FEATURES' keys (x always), values of every edge: NaN
    payloads, -0.0, infinities, int64 extremes, empty bytes and lists, and a key no
    feature asks for."""
    floats = rng.standard_normal(3).astype(np.float32)
    floats[rng.integers(3)] = rng.choice(np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45],
                                                  np.float32))
    values = {"x": floats.view(np.uint32).astype(np.uint32)}
    fields = {"x": {"float_list": {"value": floats.tolist()}}}
    extremes = [0, -1, 1, 2 ** 63 - 1, -2 ** 63, 127, 128, -129, 2 ** 35]
    if rng.random() < 0.7:
        fields["label"] = {"int64_list": {"value": [int(rng.choice(extremes))]}}
    if rng.random() < 0.7:
        fields["name"] = {"bytes_list": {"value": [bytes(rng.integers(0, 256, rng.integers(0, 5),
                                                               dtype=np.uint8))]}}
    n = int(rng.integers(0, 5))
    if rng.random() < 0.8:
        fields["tags"] = {"int64_list": {"value": [int(rng.choice(extremes)) for _ in range(n)]}}
    if rng.random() < 0.8:
        fields["weights"] = {"float_list": {"value": rng.standard_normal(n).astype(
            np.float32).tolist()}}
    if rng.random() < 0.8:
        fields["blobs"] = {"bytes_list": {"value": [b"\x00" * k for k in range(n)]}}
    if rng.random() < 0.5:
        fields["grid"] = {"int64_list": {"value": rng.integers(-300, 300, 4).tolist()}}
    if rng.random() < 0.5:
        fields["a_name_longer_than_8"] = {"bytes_list": {"value": ["é".encode()] * n}}
    if rng.random() < 0.5:
        fields["unasked"] = {"float_list": {"value": [1.0]}}
    del values
    return ex.messages.serialize("Example", {"features": {"feature": fields}})


def same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = got[name], want[name]
        if isinstance(b, ms.io.SparseTensorValue):
            same({"i": a.indices, "v": a.values, "s": a.dense_shape},
                 {"i": b.indices, "v": b.values, "s": b.dense_shape})
            continue
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        if a.dtype == object:
            assert a.tolist() == b.tolist() and all(type(v) is bytes for v in a.reshape(-1))
        else:
            assert a.tobytes() == b.tobytes(), name       # bit for bit (NaN payloads too)


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_parse_as_record_by_record(seed):
    rng = np.random.default_rng(seed)
    records = [random_example(rng) for _ in range(int(rng.integers(1, 40)))]
    specs = ex._specs(FEATURES)
    fast = parse_batch(records, specs)
    assert fast is not None                        # protobuf's encodings are canonical
    same(fast, ex.parse_each(records, specs))


@pytest.mark.parametrize("floats", [31, 32, 4096, 1 << 19])
def test_long_features_are_parsed_at_once(floats):
    """Lengths of one to four varint bytes (a 2 MiB float list); still the batch path."""
    rng = np.random.default_rng(floats)
    records = [ex.serialize_example({"x": rng.standard_normal(floats).astype(np.float32),
                                     "n": rng.integers(-9, 9, floats // 8 + 1)})
               for _ in range(3)]
    specs = ex._specs({"x": ms.io.FixedLenFeature([floats], "float32"),
                       "n": ms.io.VarLenFeature("int64")})
    fast = parse_batch(records, specs)
    assert fast is not None
    same(fast, ex.parse_each(records, specs))


def entry(key: bytes, feature: bytes) -> bytes:
    body = b"\x0a" + varint(len(key)) + key + b"\x12" + varint(len(feature)) + feature
    return b"\x0a" + varint(len(body)) + body


def example(*entries: bytes) -> bytes:
    features = b"".join(entries)
    return b"\x0a" + varint(len(features)) + features


def float_list_unpacked(values) -> bytes:
    body = b"".join(b"\x0d" + struct.pack("<f", v) for v in values)
    return b"\x12" + varint(len(body)) + body


def int64_list(values, extra=b"") -> bytes:
    packed = b"".join(varint(v & (2 ** 64 - 1)) for v in values)
    body = b"\x0a" + varint(len(packed)) + packed + extra
    return b"\x1a" + varint(len(body)) + body


GOOD = ex.serialize_example({"x": [1.0, 2.0, 3.0], "tags": [5, 6]})
UNUSUAL = {
    "unpacked floats": example(entry(b"x", float_list_unpacked([1.0, 2.0, 3.0]))),
    "an unknown field in a list": example(entry(b"x", float_list_unpacked([1, 2, 3])),
                                          entry(b"tags", int64_list([7], b"\x10\x01"))),
    "a key given twice (the last wins)": example(entry(b"x", float_list_unpacked([1, 2, 3])),
                                                 entry(b"tags", int64_list([1])),
                                                 entry(b"tags", int64_list([2, 3]))),
    "the features field twice (merged)": example(entry(b"tags", int64_list([9]))) +
    example(entry(b"x", float_list_unpacked([4, 5, 6]))),
    "an empty record: every default": b"",
    "a length past the end (read to the end)": b"\x0a\x7f" + GOOD[2:],
}


@pytest.mark.parametrize("name", sorted(UNUSUAL))
def test_unusual_encodings_give_what_the_record_by_record_path_gives(name):
    features = {"x": ms.io.FixedLenFeature([3], "float32", default_value=[0.5] * 3),
                "tags": ms.io.VarLenFeature("int64")}
    records = [GOOD, UNUSUAL[name], GOOD]
    same(ms.io.parse_example(records, features), ex.parse_each(records, ex._specs(features)))
    want = ms.io.parse_single_example(UNUSUAL[name], features)
    got = ms.io.parse_example([UNUSUAL[name]], features)
    assert got["x"][0].tobytes() == want["x"].tobytes()
    assert got["tags"].values.tolist() == want["tags"].values.tolist()


BAD = {
    "truncated": GOOD[:-3],
    "a varint of 11 bytes": example(entry(b"tags", b"\x1a\x0d\x0a\x0b" + b"\xff" * 10 + b"\x01")),
    "a wrong type": example(entry(b"x", int64_list([1, 2, 3]))),
    "a wrong count": ex.serialize_example({"x": [1.0, 2.0]}),
    "a required feature missing": ex.serialize_example({"tags": [1]}),
    "a group": b"\x0b" + GOOD,
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_records_raise_what_the_record_by_record_path_raises(name):
    features = {"x": ms.io.FixedLenFeature([3], "float32"), "tags": ms.io.VarLenFeature("int64")}
    records = [GOOD, BAD[name]]
    with pytest.raises(ms.errors.InvalidArgumentError) as batch:
        ms.io.parse_example(records, features)
    with pytest.raises(ms.errors.InvalidArgumentError) as each:
        ex.parse_each(records, ex._specs(features))
    assert str(batch.value) == str(each.value)


def test_a_record_gets_the_same_answer_whatever_else_is_in_its_batch():
    """TensorFlow reads the features asked for, under keys compared as bytes: a record with a
    broken feature nobody asked for, or a key that is not UTF-8, parses (protobuf refused
    it), and parses the same alone, in a batch of canonical records (the batch path) and
    beside an unusual one (record by record)."""
    x = ex.messages.serialize("Feature", {"int64_list": {"value": [1]}})
    broken_unasked = example(entry(b"x", x), entry(b"y", b"\x1a\x01\x80"))
    bad_key = example(entry(b"x", x), entry(b"\xff", x))
    truncated_varint = example(entry(b"x", x), entry(b"y", b"\x1a\x03\x0a\x01\x80"))
    features = {"x": ms.io.FixedLenFeature([], "int64")}
    good = example(entry(b"x", x))
    unpacked = example(entry(b"x", b"\x1a\x02\x08\x05"))     # valid, left to that path
    assert ms.io.parse_example([good, unpacked], features)["x"].tolist() == [1, 5]
    for record in (broken_unasked, bad_key, truncated_varint):
        assert ms.io.parse_single_example(record, features)["x"].tolist() == 1
        assert parse_batch([good, record], ex._specs(features)) is not None
        for batch in ([record], [good, record], [record, unpacked]):
            want = [1, 1] if batch[0] is good else [1, 5][:len(batch)]
            assert ms.io.parse_example(batch, features)["x"].tolist() == want
    accented = example(entry(b"x", x), entry("cl\u00e9".encode(), x))
    alone = ms.io.parse_example([accented], features)["x"].tolist()
    assert alone == ms.io.parse_example([accented, accented], features)["x"].tolist()[:1] == [1]
    broken_asked = example(entry(b"x", b"\x1a\x01\x80"))
    for batch in ([broken_asked], [good, broken_asked], [broken_asked, unpacked]):
        with pytest.raises(ms.errors.InvalidArgumentError, match="example"):
            ms.io.parse_example(batch, features)


# -- batches whose records share one layout (example_uniform.py: read as a matrix) ----------

def float_list(bits) -> bytes:
    packed = np.asarray(bits, np.uint32).astype("<u4").tobytes()
    body = b"\x0a" + varint(len(packed)) + packed
    return b"\x12" + varint(len(body)) + body


def raw_int64_list(payload: bytes) -> bytes:
    """A packed int64 list of the given varint bytes (their count follows their high bits)."""
    body = b"\x0a" + varint(len(payload)) + payload
    return b"\x1a" + varint(len(body)) + body


def bytes_list(values) -> bytes:
    body = b"".join(b"\x0a" + varint(len(v)) + v for v in values)
    return b"\x0a" + varint(len(body)) + body


UNIFORM = {"x": ms.io.FixedLenFeature([4], "float32"),
           "label": ms.io.FixedLenFeature([], "int64"),
           "name": ms.io.FixedLenFeature([2], "string"),
           "tags": ms.io.VarLenFeature("int64"),
           "empty": ms.io.VarLenFeature("float32"),
           "missing": ms.io.FixedLenFeature([2], "int64", default_value=[7, -7]),
           "absent": ms.io.VarLenFeature("string")}


def uniform_record(rng, tags_payload: int = 3, label_bytes: int = 1) -> bytes:
    """One layout, random values: float bits of every kind (NaN payloads), a label of
    ``label_bytes`` varint bytes, two 3-byte strings, 3 bytes of varints (1 to 3 values:
    their high bits decide), an empty float list and a feature nobody asked for (its bytes
    differ too)."""
    payload = rng.integers(0, 256, tags_payload, dtype=np.uint8)
    payload[-1] &= 0x7F                                        # (ends a varint)
    low = 0 if label_bytes == 1 else 1 << 7 * (label_bytes - 1)
    label = int(rng.integers(low, min(1 << 7 * label_bytes, 1 << 64), dtype=np.uint64))
    return example(entry(b"x", float_list(rng.integers(0, 2 ** 32, 4, dtype=np.uint64))),
                   entry(b"label", raw_int64_list(varint(label))),
                   entry(b"name", bytes_list([rng.bytes(3), rng.bytes(3)])),
                   entry(b"tags", raw_int64_list(payload.tobytes())),
                   entry(b"empty", b"\x12\x00"),
                   entry(b"unasked", bytes_list([rng.bytes(5)])))


@pytest.mark.parametrize("seed", range(12))
def test_records_of_one_layout_parse_as_record_by_record(seed):
    from mpistrat.io.example_uniform import JoinedRecords, uniform_columns
    rng = np.random.default_rng(seed)
    label_bytes = [1, 2, 3, 10][seed % 4]                        # (10: int64's negatives)
    records = [uniform_record(rng, label_bytes=label_bytes)
               for _ in range(int(rng.integers(1, 300)))]
    specs = ex._specs(UNIFORM)
    assert uniform_columns(JoinedRecords(records), specs) is not None          # the matrix path ran
    same(ms.io.parse_example(records, UNIFORM), ex.parse_each(records, specs))


def test_records_of_one_length_but_another_layout_take_the_general_way():
    """Same length, but a key, a tag or a length's encoding differs: not one layout."""
    from mpistrat.io.example_uniform import JoinedRecords, uniform_columns
    rng = np.random.default_rng(5)
    one = uniform_record(rng)
    variants = {
        "another key": one.replace(b"tags", b"tbgs"),
        "an unpacked list": one[:one.index(b"tags") + 6] + b"\x1a\x05\x08\x01\x08\x81\x01" +
        one[one.index(b"tags") + 13:],
        "a key nobody asked for": one.replace(b"unasked", b"unaskee"),
    }
    features = dict(UNIFORM, tbgs=ms.io.VarLenFeature("int64"))
    specs = ex._specs(features)
    for name, other in variants.items():
        assert len(other) == len(one) and other != one, name
        records = [one, other, one]
        assert uniform_columns(JoinedRecords(records), specs) is None, name
        same(ms.io.parse_example(records, features), ex.parse_each(records, specs))
    longer = example(entry(b"label", b"\x1a\x83\x00\x0a\x01\x05"))   # a non-minimal length
    assert uniform_columns(JoinedRecords([longer]), ex._specs({"label": UNIFORM["label"]})) is None
    assert ms.io.parse_example([longer], {"label": UNIFORM["label"]})["label"].tolist() == [5]


def test_a_count_that_differs_under_one_layout_raises_as_record_by_record():
    """Two varint bytes are two values in one record and one in the next: a FixedLen [2]
    feature must raise the record-by-record path's error, a VarLen one count each."""
    records = [example(entry(b"n", raw_int64_list(b"\x01\x02"))),
               example(entry(b"n", raw_int64_list(b"\x81\x01")))]
    fixed = {"n": ms.io.FixedLenFeature([2], "int64")}
    with pytest.raises(ms.errors.InvalidArgumentError) as batch:
        ms.io.parse_example(records, fixed)
    with pytest.raises(ms.errors.InvalidArgumentError) as each:
        ex.parse_each(records, ex._specs(fixed))
    assert str(batch.value) == str(each.value)
    ragged = {"n": ms.io.VarLenFeature("int64")}
    got = ms.io.parse_example(records, ragged)["n"]
    assert got.values.tolist() == [1, 2, 129] and got.indices.tolist() == [[0, 0], [0, 1], [1, 0]]
    same(ms.io.parse_example(records, ragged), ex.parse_each(records, ex._specs(ragged)))


def test_serialized_bytes_keep_their_trailing_zero_bytes():
    """NumPy's ``S`` arrays drop trailing zero bytes; ``serialize_example`` writes the bytes
    given (as ``tf.train.BytesList`` does), a list, a nested list or one value."""
    for values, flat in (([b"ab\x00", b"\x00"], [b"ab\x00", b"\x00"]),
                         ([[b"a\x00"], [b"b"]], [b"a\x00", b"b"]), (b"x\x00\x00", [b"x\x00\x00"])):
        record = ex.serialize_example({"s": values})
        assert record == ex.messages.serialize(
            "Example", {"features": {"feature": {"s": {"bytes_list": {"value": flat}}}}})
        parsed = ms.io.parse_example([record], {"s": ms.io.VarLenFeature("string")})
        assert parsed["s"].values.tolist() == flat


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_an_empty_last_string_of_one_layout_is_an_empty_string_in_every_record(count):
    """The last string of a record that is empty starts at the record's length (review)."""
    records = [ex.serialize_example({"x": [float(k)], "z": [b""]}) for k in range(count)]
    assert all(r.endswith(b"\x0a\x02\x0a\x00") for r in records)   # (keys sorted: z last)
    for feature in (ms.io.FixedLenFeature([], "string"), ms.io.VarLenFeature("string")):
        features = {"z": feature, "x": ms.io.FixedLenFeature([], "float32")}
        same(ms.io.parse_example(records, features), ex.parse_each(records, ex._specs(features)))


def test_features_checked_before_are_told_apart_by_name_text_and_shape():
    """The checked-features cache keys names as the specs name them (1 and True hash alike)
    and keeps only list or tuple shapes (a generator is read once)."""
    record = ex.serialize_example({"1": [5], "True": [6], "x": [1.0, 2.0]})
    int64 = ms.io.FixedLenFeature([], "int64")
    assert ms.io.parse_example([record], {1: int64})["1"].tolist() == [5]
    assert ms.io.parse_example([record], {True: int64})["True"].tolist() == [6]
    for _ in range(2):
        shape = (d for d in [2])
        got = ms.io.parse_example([record], {"x": ms.io.FixedLenFeature(shape, "float32")})
        assert got["x"].tolist() == [[1.0, 2.0]]
