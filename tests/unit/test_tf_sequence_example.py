"""SequenceExample parsing and FixedLenSequenceFeature, against what TensorFlow 2.21 gave
for the same records and specs (tests/data/tf/sequence, made by make_tf_fixtures.py): every
output bit for bit, and an error wherever TensorFlow raised one. The records are read from
the TFRecord files TensorFlow wrote."""

import json
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import InvalidArgumentError

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())["sequence"]
CASES = REPORT["cases"]

CONTEXT = {"id": ms.io.FixedLenFeature([], "int64"),
           "name": ms.io.FixedLenFeature([], "string"),
           "w": ms.io.FixedLenFeature([], "float32", default_value=-1.0),
           "name_var": ms.io.VarLenFeature("string")}
SPECS = {
    "all": (CONTEXT, {
        "tok": ms.io.FixedLenSequenceFeature([], "int64", allow_missing=True),
        "emb": ms.io.FixedLenSequenceFeature([2], "float32", allow_missing=True),
        "words": ms.io.VarLenFeature("string"), "ids": ms.io.VarLenFeature("int64")}),
    "required": (None, {"tok": ms.io.FixedLenSequenceFeature([], "int64")}),
    "wrong_count": (None, {"emb": ms.io.FixedLenSequenceFeature([3], "float32",
                                                                allow_missing=True)}),
    "wrong_type": (None, {"tok": ms.io.FixedLenSequenceFeature([], "float32",
                                                               allow_missing=True)}),
    "strings_padded": ({"id": ms.io.FixedLenFeature([], "int64")},
                       {"words_all": ms.io.VarLenFeature("string")}),
    "context_only": ({"id": ms.io.FixedLenFeature([], "int64"),
                      "missing": ms.io.VarLenFeature("float32")}, None),
}
DENSE = {"t": ms.io.FixedLenSequenceFeature([2], "int64", allow_missing=True, default_value=-1),
         "f": ms.io.FixedLenSequenceFeature([], "float32", allow_missing=True)}


def records(name):
    """The records of TensorFlow's file, as our reader reads them (and as TF listed them)."""
    got = [bytes(r) for r in ms.data.TFRecordDataset(str(DATA / "sequence" / name))]
    assert [r.hex() for r in got] == REPORT[name.split(".")[0]]
    return got


def as_report(value) -> dict:
    if isinstance(value, ms.io.SparseTensorValue):
        return {"values": as_report(value.values), "indices": value.indices.tolist(),
                "dense_shape": value.dense_shape.tolist()}
    value = np.asarray(value)
    if value.dtype == object:
        return {"shape": list(value.shape), "strings": [bytes(v).hex() for v in value.reshape(-1)]}
    return {"shape": list(value.shape), "hex": np.ascontiguousarray(value).tobytes().hex()}


def check(want: dict, call) -> None:
    """``call()`` gives TensorFlow's outputs bit for bit, or raises where TensorFlow did."""
    if "error" in want:
        with pytest.raises(InvalidArgumentError):
            call()
        return
    got = call()
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want["parts"])
    for ours, theirs in zip(got, want["parts"]):
        assert {k: as_report(v) for k, v in ours.items()} == theirs


@pytest.mark.parametrize("case", sorted(SPECS))
def test_each_sequence_example_parses_as_tensorflow_parsed_it(case):
    context, sequence = SPECS[case]
    for record, want in zip(records("sequences.tfrecord"), CASES[case]["single"]):
        check(want, lambda: ms.io.parse_single_sequence_example(record, context, sequence))


@pytest.mark.parametrize("case", sorted(SPECS))
@pytest.mark.parametrize("part", ["batch", "batch_first_four"])
def test_batches_of_sequence_examples_parse_as_tensorflow_parsed_them(case, part):
    context, sequence = SPECS[case]
    batch = records("sequences.tfrecord")[:4 if part == "batch_first_four" else None]
    check(CASES[case][part], lambda: ms.io.parse_sequence_example(batch, context, sequence))
    check(CASES[case][part], lambda: ms.io.parse_sequence_example(
        np.array(batch, dtype=object), context, sequence))


def test_fixed_len_sequence_features_of_examples_are_dense_and_padded_as_tensorflows():
    examples = records("examples.tfrecord")
    case = CASES["example_sequence_features"]
    for record, want in zip(examples, case["single"]):
        check(want, lambda: ms.io.parse_single_example(record, DENSE))
    check(case["batch"], lambda: ms.io.parse_example(examples, DENSE))
    check(CASES["example_not_a_multiple"]["batch"], lambda: ms.io.parse_example(
        examples, {"t": ms.io.FixedLenSequenceFeature([3], "int64", allow_missing=True)}))


def test_specs_tensorflow_refuses_are_refused_before_parsing():
    record = records("sequences.tfrecord")[1]
    with pytest.raises(ValueError, match="allow_missing"):
        ms.io.parse_example([b""], {"t": ms.io.FixedLenSequenceFeature([], "int64")})
    with pytest.raises(InvalidArgumentError, match="give a scalar"):
        ms.io.parse_example([b""], {"t": ms.io.FixedLenSequenceFeature(
            [2], "int64", allow_missing=True, default_value=[1, 2])})
    with pytest.raises(ValueError, match="default_value must be None"):
        ms.io.parse_single_sequence_example(record, None, {"tok": ms.io.FixedLenSequenceFeature(
            [], "int64", allow_missing=True, default_value=3)})
    with pytest.raises(ValueError, match="sequence_features"):
        ms.io.parse_single_sequence_example(record, {"tok": ms.io.FixedLenSequenceFeature(
            [], "int64", allow_missing=True)})
    with pytest.raises(ValueError, match="at least one should have values"):
        ms.io.parse_sequence_example([record], None, {})
    with pytest.raises(ValueError, match="expected FixedLenSequenceFeature or VarLenFeature"):
        ms.io.parse_single_sequence_example(record, None, {"tok": ms.io.FixedLenFeature(
            [], "int64")})


@pytest.mark.parametrize("bad", [b"\x12\x05\x0a\x03", b"\x0b", b"\x12\x03\x0a\x01\x0a"])
def test_malformed_sequence_examples_raise_naming_the_example(bad):
    good = records("sequences.tfrecord")[2]
    with pytest.raises(InvalidArgumentError, match="example 1"):
        ms.io.parse_sequence_example([good, bad], None,
                                     {"words": ms.io.VarLenFeature("string")})
