"""``tf.train.SequenceExample`` parsing, as ``tf.io.parse_single_sequence_example`` and
``tf.io.parse_sequence_example``, to NumPy.

A SequenceExample holds ``context`` features (one ``Features``, parsed as an Example's:
``FixedLenFeature`` and ``VarLenFeature``) and ``feature_lists`` (per name, a list of
``Feature``, one per step). Sequence features are ``FixedLenSequenceFeature(shape, dtype,
allow_missing)`` (each step holds exactly one item of ``shape``: an array ``[steps] +
shape``, padded with zeros to the longest in a batch, whose lengths are returned) or
``VarLenFeature`` (a :class:`SparseTensorValue` over ``[step, value]``, or ``[example,
step, value]`` for a batch). A missing list is empty when ``allow_missing`` (always for
VarLen), else an ``InvalidArgumentError`` naming it, as in TensorFlow::

    >>> import mpistrat as ms
    >>> from mpistrat.tfformats import messages
    >>> def record(tokens):
    ...     return messages.serialize("SequenceExample", {
    ...         "context": {"feature": {"id": {"int64_list": {"value": [7]}}}},
    ...         "feature_lists": {"feature_list": {"tok": {"feature": [
    ...             {"int64_list": {"value": [t]}} for t in tokens]}}}})
    >>> context, sequence = ms.io.parse_single_sequence_example(
    ...     record([1, 2]), {"id": ms.io.FixedLenFeature([], "int64")},
    ...     {"tok": ms.io.FixedLenSequenceFeature([], "int64")})
    >>> int(context["id"]), sequence["tok"].tolist()
    (7, [1, 2])
    >>> _, batch, lengths = ms.io.parse_sequence_example(
    ...     [record([1, 2]), record([3])], None, {"tok": ms.io.FixedLenSequenceFeature([], "int64")})
    >>> batch["tok"].tolist(), lengths["tok"].tolist()
    ([[1, 2], [3, 0]], [2, 1])

Records are parsed one by one with protobuf (or the pure-Python wire reader); the context
goes through ``parse_example``.
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mpistrat.errors import DataLossError, InvalidArgumentError
from mpistrat.io import example as ex
from mpistrat.io.example_batch import ragged_positions
from mpistrat.tfformats import messages
from mpistrat.tfformats.wire import WireError, read_varint, varint

__all__ = ["parse_single_sequence_example", "parse_sequence_example"]


class _Sequence:
    """A sequence feature, checked once: the per-step feature and how a missing list reads."""

    def __init__(self, name: str, feature):
        if isinstance(feature, ex.FixedLenSequenceFeature):
            if feature.default_value is not None:
                raise ValueError(f"sequence feature {name!r}: default_value must be None "
                                 f"(as TensorFlow's feature_list.dense_defaults)")
            self.step = ex._Spec(name, ex.FixedLenFeature(feature.shape, feature.dtype))
            self.dense, self.allow_missing = True, bool(feature.allow_missing)
        elif isinstance(feature, ex.VarLenFeature):
            self.step = ex._Spec(name, feature)
            self.dense, self.allow_missing = False, True
        else:
            raise ValueError(f"sequence feature {name!r}: expected FixedLenSequenceFeature or "
                             f"VarLenFeature, got {type(feature).__name__}")
        self.name = name

    def steps(self, lists, index: int) -> List[Any]:
        """Each step's values (checked) of example ``index``'s list."""
        if self.name not in lists:
            if not self.allow_missing:
                raise InvalidArgumentError(
                    f"Name: <unknown>, Feature list '{self.name}' is required but could not be "
                    f"found (example {index}).  Did you mean to set allow_missing=True?")
            return []
        return [self.step.values(feature, index)
                for feature in lists[self.name].feature]


def _fields(record, index: int) -> Tuple[bytes, bytes]:
    """The context's and the feature lists' bytes of a SequenceExample (each field's
    occurrences joined, as protobuf merges them); unknown fields skipped."""
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"example {index}: expected serialized bytes, got "
                                   f"{type(record).__name__}")
    data, parts = bytes(record), {1: [], 2: []}
    pos = 0
    try:
        while pos < len(data):
            key, pos = read_varint(data, pos, len(data))
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = read_varint(data, pos, len(data))
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, pos = read_varint(data, pos, len(data))
                if number in parts:
                    parts[number].append(data[pos:pos + length])
                pos += length
            else:
                raise WireError(f"wire type {wire_type}")
            if pos > len(data):
                raise WireError("a field runs past the end")
    except WireError as err:
        raise InvalidArgumentError(f"Could not parse example input (example {index}): "
                                   f"{err}") from None
    return b"".join(parts[1]), b"".join(parts[2])


def _lists(data: bytes, index: int):
    try:
        return messages.parse("FeatureLists", data, f"example {index}").feature_list
    except DataLossError as err:
        raise InvalidArgumentError(f"Could not parse example input: {err}") from None


def _as_example(context: bytes) -> bytes:
    return b"\x0a" + varint(len(context)) + context if context else b""


def _context_specs(features) -> Optional[Dict[str, Any]]:
    if not features:
        return None
    for name, feature in features.items():
        if isinstance(feature, ex.FixedLenSequenceFeature):
            raise ValueError(f"context feature {name!r}: a FixedLenSequenceFeature belongs in "
                             f"sequence_features")
    return features


def _sequences(features) -> List[_Sequence]:
    return [_Sequence(str(n), f) for n, f in sorted((features or {}).items())]


def _sparse(steps_per_example: List[List[Any]], spec, batch: bool) -> ex.SparseTensorValue:
    """VarLen steps as a sparse value over ``[step, j]`` (``[example, step, j]``)."""
    flat = [piece for steps in steps_per_example for piece in steps]
    counts = np.array([ex._count(p, spec) for p in flat], dtype=np.int64)
    values = ex._array(flat, spec) if flat else np.zeros(0, spec.numpy)
    example, step = ragged_positions([len(s) for s in steps_per_example])   # per step
    of_step, position = ragged_positions(counts)                           # per value
    columns = [step[of_step], position]
    longest = max([len(s) for s in steps_per_example] or [0])
    shape = [longest, int(counts.max()) if len(counts) else 0]
    if batch:
        columns.insert(0, example[of_step])
        shape.insert(0, len(steps_per_example))
    indices = np.stack(columns, axis=1).astype(np.int64).reshape(-1, len(columns))
    return ex.SparseTensorValue(indices, values, np.array(shape, dtype=np.int64))


def _dense(steps: List[Any], spec) -> np.ndarray:
    if not steps:
        return np.zeros((0,) + spec.shape, dtype=spec.numpy)
    return ex._array(steps, spec).reshape((len(steps),) + spec.shape)


def _parse(records: List[Any], context_features, sequence_features):
    if not context_features and not sequence_features:
        raise ValueError("context_features and sequence_features are both empty: at least "
                         "one should have values (as TensorFlow requires)")
    sequences = _sequences(sequence_features)
    contexts, steps = [], {s.name: [] for s in sequences}
    for index, record in enumerate(records):
        context, lists = _fields(record, index)
        contexts.append(_as_example(context))
        found = _lists(lists, index) if sequences else {}
        for sequence in sequences:
            steps[sequence.name].append(sequence.steps(found, index))
    return sequences, contexts, steps


def parse_single_sequence_example(serialized, context_features=None, sequence_features=None,
                                  example_name=None, name=None) -> Tuple[Dict, Dict]:
    """One serialized SequenceExample: ``(context, sequences)``, dicts of arrays (dense
    sequence features ``[steps] + shape``) and :class:`SparseTensorValue`."""
    if isinstance(serialized, np.ndarray) and serialized.shape == ():
        serialized = serialized[()]
    context_specs = _context_specs(context_features)
    sequences, contexts, steps = _parse([serialized], context_features, sequence_features)
    context = ex.parse_single_example(contexts[0], context_specs) if context_specs else {}
    out = {}
    for sequence in sequences:
        mine = steps[sequence.name][0]
        out[sequence.name] = _dense(mine, sequence.step) if sequence.dense else \
            _sparse([mine], sequence.step, batch=False)
    return context, out


def parse_sequence_example(serialized, context_features=None, sequence_features=None,
                           example_names=None, name=None) -> Tuple[Dict, Dict, Dict]:
    """A batch of serialized SequenceExamples: ``(context, sequences, lengths)``; dense
    sequence features are ``[batch, longest] + shape`` padded with zeros (empty strings),
    and ``lengths`` gives each example's number of steps for them."""
    records = list(np.asarray(serialized, dtype=object).reshape(-1)) \
        if not isinstance(serialized, (list, tuple)) else list(serialized)
    context_specs = _context_specs(context_features)
    sequences, contexts, steps = _parse(records, context_features, sequence_features)
    context = ex.parse_example(contexts, context_specs) if context_specs else {}
    out, lengths = {}, {}
    for sequence in sequences:
        per_example = steps[sequence.name]
        if not sequence.dense:
            out[sequence.name] = _sparse(per_example, sequence.step, batch=True)
            continue
        counts = np.array([len(s) for s in per_example], dtype=np.int64)
        spec = sequence.step
        dense = np.zeros((len(records), int(counts.max()) if len(counts) else 0) + spec.shape,
                         dtype=spec.numpy)
        if spec.dtype == "string":
            dense[...] = b""
        for row, mine in enumerate(per_example):
            dense[row, :len(mine)] = _dense(mine, spec)
        out[sequence.name], lengths[sequence.name] = dense, counts
    return context, out, lengths
