"""``ms.io``'s Example and SequenceExample parsing against TensorFlow 2.21 on every record of
tests/data/parse_oracle.json.gz (made by tests/data/make_parse_oracle.py with real
TensorFlow): canonical records, one record per encoding TensorFlow's fast parser reads its
own way, random encodings of every level and random byte mutations, under several specs.
Each answer is TensorFlow's, bit for bit, or an error where TensorFlow raised one (its
``InvalidArgumentError`` is ours; where TensorFlow crashed, ours is an InvalidArgumentError
too), for ``parse_single_example``, ``parse_example`` of each record alone, of the batches
TensorFlow parsed and of batches of every size from 1 to 300 (a batch's answer is its
records' answers stacked or joined, or an error if any record has one: what TensorFlow
gives, checked by the generator against TensorFlow's own batches)."""

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import InvalidArgumentError

DATA = Path(__file__).resolve().parents[1] / "data"
ORACLE = json.loads(gzip.decompress((DATA / "parse_oracle.json.gz").read_bytes()))
EXAMPLES = [bytes.fromhex(r) for r in ORACLE["examples"]]
SEQUENCES = [bytes.fromhex(r) for r in ORACLE["sequences"]]
_spec = importlib.util.spec_from_file_location("make_parse_oracle",
                                               DATA / "make_parse_oracle.py")
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)          # (its batch rules; TensorFlow only in its main())


def feature(kind, shape, dtype, default, allow_missing):
    if kind == "fixed":
        return ms.io.FixedLenFeature(shape, dtype, default_value=default)
    if kind == "var":
        return ms.io.VarLenFeature(dtype)
    return ms.io.FixedLenSequenceFeature(shape, dtype, allow_missing=allow_missing,
                                         default_value=default)


def features(description):
    if description is None:
        return None
    return {name: feature(*args) for name, args in description.items()}


def tensor(value) -> dict:
    value = np.asarray(value)
    if value.dtype == object:
        assert all(type(v) is bytes for v in value.reshape(-1))
        return {"shape": list(value.shape), "strings": [v.hex() for v in value.reshape(-1)]}
    return {"shape": list(value.shape), "dtype": value.dtype.name,
            "hex": np.ascontiguousarray(value).tobytes().hex()}


def output(out: dict) -> dict:
    result = {}
    for name, value in out.items():
        if isinstance(value, ms.io.SparseTensorValue):
            assert value.indices.dtype == np.int64 and value.dense_shape.dtype == np.int64
            result[name] = {"indices": value.indices.reshape(-1).tolist(),
                            "values": tensor(value.values),
                            "dense_shape": value.dense_shape.tolist()}
        else:
            result[name] = tensor(value)
    return result


def answer(call) -> dict:
    """Ours in the oracle's form: the values, or the class of the error."""
    try:
        got = call()
    except InvalidArgumentError:
        return {"error": "InvalidArgumentError"}
    except Exception as err:  # noqa: BLE001 - reported as the oracle reports TensorFlow's
        return {"error": type(err).__name__}
    if isinstance(got, tuple):
        parts = dict(zip(("context", "sequence", "lengths"), got))
        return {k: output(v) for k, v in parts.items()}
    return {"values": output(got)}


def expected(want: dict) -> dict:
    """TensorFlow's answer as ours must read: a crash is an InvalidArgumentError here (and
    so is an InvalidArgumentError whose message, quoting the record, TensorFlow could not
    decode: it raised UnicodeDecodeError)."""
    if "error" in want:
        return {"error": "InvalidArgumentError" if want["error"] == "Crash" else want["error"]}
    return want


def differences(pairs):
    """(label, ours, TensorFlow's) of every case that differs, the first few shown."""
    bad = [(label, got, want) for label, got, want in pairs if got != expected(want)]
    return len(bad), [(label, str(got)[:300], str(want)[:300]) for label, got, want in bad[:3]]


def _label(index: int, origins) -> str:
    return f"record {index} ({origins[index]})"


@pytest.mark.parametrize("spec", sorted(ORACLE["example_specs"]))
def test_each_example_parses_alone_as_tensorflow_parsed_it(spec):
    wanted = features(ORACLE["example_specs"][spec])
    pairs = []
    for index, want in enumerate(ORACLE["single"][spec]):
        record = EXAMPLES[index]
        pairs.append((_label(index, ORACLE["example_origins"]),
                      answer(lambda: ms.io.parse_single_example(record, wanted)), want))
    assert differences(pairs) == (0, [])


@pytest.mark.parametrize("spec", sorted(ORACLE["example_specs"]))
def test_each_example_in_a_batch_of_one_parses_as_tensorflow_parsed_it(spec):
    wanted = features(ORACLE["example_specs"][spec])
    pairs = []
    for index, want in enumerate(ORACLE["batch1"][spec]):
        record = EXAMPLES[index]
        pairs.append((_label(index, ORACLE["example_origins"]),
                      answer(lambda: ms.io.parse_example([record], wanted)), want))
    assert differences(pairs) == (0, [])


@pytest.mark.parametrize("spec", sorted(ORACLE["example_specs"]))
def test_batches_parse_as_tensorflow_parsed_them(spec):
    wanted = features(ORACLE["example_specs"][spec])
    pairs = []
    for batch in ORACLE["batches"][spec]:
        records = [EXAMPLES[i] for i in batch["records"]]
        pairs.append((f"batch of {len(records)}",
                      answer(lambda: ms.io.parse_example(records, wanted)), batch["answer"]))
        pairs.append((f"batch of {len(records)} (an object array)", answer(
            lambda: ms.io.parse_example(np.array(records + [b""], object)[:-1], wanted)),
            batch["answer"]))
    assert differences(pairs) == (0, [])


def _every_size(answers, origins, count=300):
    """Batches of 1 to ``count`` records: of canonical records only (the batch path), of
    any records TensorFlow accepts (mostly record by record), and every fifth with one it
    refuses."""
    good = [i for i, a in enumerate(answers) if "error" not in a]
    canonical = [i for i in good if origins[i] == "canonical"] or good
    bad = [i for i, a in enumerate(answers) if "error" in a]
    for size in range(1, count + 1):
        pool = canonical if size % 2 else good
        start = (size * 37) % len(pool)
        batch = [pool[(start + j) % len(pool)] for j in range(size)]
        if size % 5 == 0 and bad:
            batch[(size // 5 * 7) % size] = bad[(size * 13) % len(bad)]
        yield batch


@pytest.mark.parametrize("spec", sorted(s for s in ORACLE["example_specs"]
                                        if s != "broadcast_default"))
def test_every_batch_size_to_300_parses_as_tensorflow_parses_it(spec):
    description = ORACLE["example_specs"][spec]
    wanted, answers = features(description), ORACLE["batch1"][spec]
    pairs = []
    for batch in _every_size(answers, ORACLE["example_origins"]):
        records = [EXAMPLES[i] for i in batch]
        want = maker.compose_example([expected(answers[i]) for i in batch], description)
        pairs.append((f"records {batch[:4]}... ({len(batch)})",
                      answer(lambda: ms.io.parse_example(records, wanted)), want))
    assert differences(pairs) == (0, [])


@pytest.mark.parametrize("spec", sorted(ORACLE["sequence_specs"]))
def test_each_sequence_example_parses_as_tensorflow_parsed_it(spec):
    context, sequence = map(features, ORACLE["sequence_specs"][spec])
    pairs = []
    for index, (single, batch1) in enumerate(zip(ORACLE["seq_single"][spec],
                                                 ORACLE["seq_batch1"][spec])):
        record = SEQUENCES[index]
        label = _label(index, ORACLE["sequence_origins"])
        pairs.append((label, answer(lambda: ms.io.parse_single_sequence_example(
            record, context, sequence)), single))
        pairs.append((label + " in a batch", answer(lambda: ms.io.parse_sequence_example(
            [record], context, sequence)), batch1))
    assert differences(pairs) == (0, [])


@pytest.mark.parametrize("spec", sorted(ORACLE["sequence_specs"]))
def test_batches_of_sequence_examples_parse_as_tensorflow_parsed_them(spec):
    description = ORACLE["sequence_specs"][spec]
    context, sequence = map(features, description)
    answers = ORACLE["seq_batch1"][spec]
    pairs = []
    for batch in ORACLE["seq_batches"][spec]:
        records = [SEQUENCES[i] for i in batch["records"]]
        pairs.append((f"batch of {len(records)}", answer(
            lambda: ms.io.parse_sequence_example(records, context, sequence)), batch["answer"]))
    for batch in _every_size(answers, ORACLE["sequence_origins"], 120):
        records = [SEQUENCES[i] for i in batch]
        want = maker.compose_sequence([expected(answers[i]) for i in batch], description)
        pairs.append((f"records {batch[:4]}... ({len(batch)})", answer(
            lambda: ms.io.parse_sequence_example(records, context, sequence)), want))
    assert differences(pairs) == (0, [])


def test_the_oracle_covers_every_kind_of_record():
    """Canonical, crafted, structured and mutated records; answers with values and with
    errors under every spec (so that neither side can pass by always refusing)."""
    for origins in (ORACLE["example_origins"], ORACLE["sequence_origins"]):
        kinds = {o.split(":")[0] for o in origins}
        assert kinds == {"canonical", "crafted", "structured", "mutated"}
    for key in ("single", "batch1", "seq_single", "seq_batch1"):
        for spec, answers in ORACLE[key].items():
            errors = sum("error" in a for a in answers)
            if spec != "broadcast_default":
                assert errors >= 100 and len(answers) - errors >= 50, (key, spec, errors)
