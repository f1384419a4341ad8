"""``Dataset.from_generator``'s signature and the conversion of each element it yields,
as tf.data does them: a structure (dicts and tuples) of ``TensorSpec`` leaves; each
yielded element must have that structure, each value converts to its leaf's dtype without
losing its value, and its shape must fit the leaf's (``None`` matches any size; a shape of
``None`` any rank). Anything else is an ``InvalidArgumentError`` naming the element::

    >>> from mpistrat.data.specs import TensorSpec
    >>> spec = {"x": TensorSpec((2,), np.float32)}
    >>> conformed({"x": [1, 2]}, spec, 0)["x"].dtype
    dtype('float32')
    >>> conformed({"x": [1, 2, 3]}, spec, 4)
    Traceback (most recent call last):
    ...
    mpistrat.errors.InvalidArgumentError: `generator` yielded element 4 whose component ['x'] has shape (3,) where an element of shape (2,) was expected
"""

from typing import Any

import numpy as np

from mpistrat.data.specs import TensorSpec
from mpistrat.errors import InvalidArgumentError

__all__ = ["signature_of", "conformed"]


def _is_spec(value) -> bool:
    return isinstance(value, TensorSpec)


def signature_of(output_signature: Any, output_types: Any, output_shapes: Any) -> Any:
    """The signature: ``output_signature``, or one made of the older ``output_types`` and
    ``output_shapes`` (the same structure; shapes may be left out: any shape)."""
    if output_signature is not None:
        if output_types is not None or output_shapes is not None:
            raise TypeError("from_generator: give output_signature, or output_types (with "
                            "output_shapes), not both")
        _check_leaves(output_signature)
        return output_signature
    if output_types is None:
        raise TypeError("from_generator needs output_signature (a structure of "
                        "ms.data.TensorSpec) or output_types")

    def build(types, shapes):
        if isinstance(types, dict):
            return {k: build(types[k], None if shapes is None else shapes[k]) for k in types}
        if isinstance(types, tuple):
            return tuple(build(t, None if shapes is None else shapes[i])
                         for i, t in enumerate(types))
        return TensorSpec(None if shapes is None else tuple(shapes), np.dtype(types))

    return build(output_types, output_shapes)


def _check_leaves(signature) -> None:
    if isinstance(signature, dict):
        for value in signature.values():
            _check_leaves(value)
    elif isinstance(signature, tuple) and not _is_spec(signature):
        for value in signature:
            _check_leaves(value)
    elif not _is_spec(signature):
        raise TypeError(f"from_generator: output_signature must be a structure (dicts, "
                        f"tuples) of ms.data.TensorSpec, found {type(signature).__name__}")


def conformed(element: Any, signature: Any, index: int, path: tuple = ()) -> Any:
    """``element`` converted to ``signature`` (see the module docstring)."""
    where = f" whose component {list(path)}" if path else ""
    if _is_spec(signature):
        return _leaf(element, signature, index, where)
    if isinstance(signature, dict):
        if not isinstance(element, dict) or set(element) != set(signature):
            raise InvalidArgumentError(
                f"`generator` yielded element {index}{where} that did not match the expected "
                f"structure: keys {sorted(map(str, element)) if isinstance(element, dict) else type(element).__name__} "
                f"where {sorted(map(str, signature))} were expected")
        return {k: conformed(element[k], signature[k], index, path + (k,)) for k in signature}
    if not isinstance(element, (tuple, list)) or len(element) != len(signature):
        raise InvalidArgumentError(
            f"`generator` yielded element {index}{where} that did not match the expected "
            f"structure: a tuple of {len(signature)} components was expected, got "
            f"{type(element).__name__}")
    return tuple(conformed(e, s, index, path + (i,))
                 for i, (e, s) in enumerate(zip(element, signature)))


def _leaf(value, spec, index: int, where: str) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    raw = np.asarray(value)
    try:
        array = raw.astype(dtype)
        lossy = raw.dtype.kind in "fc" and dtype.kind in "iub" and not np.array_equal(
            array, raw)
    except (TypeError, ValueError):
        lossy, array = True, raw
    if lossy or (raw.dtype.kind in "USO") != (dtype.kind in "USO"):
        raise InvalidArgumentError(
            f"`generator` yielded element {index}{where} that could not be converted to "
            f"the expected type {dtype.name}: {raw.dtype.name} {np.array2string(raw)[:60]}")
    if spec.shape is not None:
        shape = tuple(spec.shape)
        if len(shape) != array.ndim or any(s is not None and s != a
                                           for s, a in zip(shape, array.shape)):
            raise InvalidArgumentError(
                f"`generator` yielded element {index}{where} has shape {array.shape} where "
                f"an element of shape {shape} was expected")
    return array
