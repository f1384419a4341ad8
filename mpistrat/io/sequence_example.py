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

Records are parsed one by one by TensorFlow's own rules (``fast_parsing.py``: its
``FastParseSequenceExample``, which reads a record's context otherwise than an Example's
features), so that every byte string gets TensorFlow's values or its error.
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mpistrat.io import example as ex
from mpistrat.io.fast_parsing import sequence_example

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


def _outputs(parts: dict) -> dict:
    return {name: ex.SparseTensorValue(*value) if isinstance(value, tuple) else value
            for name, value in parts.items()}


def _parse(records: List[Any], context_features, sequence_features, batch: bool):
    if not context_features and not sequence_features:
        raise ValueError("context_features and sequence_features are both empty: at least "
                         "one should have values (as TensorFlow requires)")
    context_specs = _context_specs(context_features)
    specs = ex._specs(context_specs) if context_specs else []
    context, sequences, lengths = sequence_example(
        records, specs, _sequences(sequence_features), batch)
    return _outputs(context), _outputs(sequences), lengths


def parse_single_sequence_example(serialized, context_features=None, sequence_features=None,
                                  example_name=None, name=None) -> Tuple[Dict, Dict]:
    """One serialized SequenceExample: ``(context, sequences)``, dicts of arrays (dense
    sequence features ``[steps] + shape``) and :class:`SparseTensorValue`."""
    if isinstance(serialized, np.ndarray) and serialized.shape == ():
        serialized = serialized[()]
    context, sequences, _ = _parse([serialized], context_features, sequence_features, False)
    return context, sequences


def parse_sequence_example(serialized, context_features=None, sequence_features=None,
                           example_names=None, name=None) -> Tuple[Dict, Dict, Dict]:
    """A batch of serialized SequenceExamples: ``(context, sequences, lengths)``; dense
    sequence features are ``[batch, longest] + shape`` padded with zeros (empty strings),
    and ``lengths`` gives each example's number of steps for them."""
    records = list(np.asarray(serialized, dtype=object).reshape(-1)) \
        if not isinstance(serialized, (list, tuple)) else list(serialized)
    return _parse(records, context_features, sequence_features, True)
