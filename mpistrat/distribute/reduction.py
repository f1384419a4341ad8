"""How a strategy combines its replicas' values before and after the collective.

Each step runs in the dtype the values combine in across ranks
(``collectives.dtypes.accumulator``: float32 for bfloat16 and float8, 64 bits for an
integer MEAN); ``restore`` rounds a result once to its input's dtype and hands it back as
its kind of array (JAX on its device)::

    >>> import numpy as np
    >>> from mpistrat.collectives import ReduceOp
    >>> from mpistrat.distribute.reduction import partial, restore
    >>> rows = np.full((3, 2), 200, np.uint8)
    >>> partial(ReduceOp.MEAN, rows, 0)            # summed wide: no wrap-around
    array([600, 600], dtype=uint64)
    >>> restore(np.array([200, 200], np.uint64), rows)
    array([200, 200], dtype=uint8)
"""

from typing import Any

import numpy as np

from mpistrat.collectives import ReduceOp, divide_for_mean
from mpistrat.collectives.dtypes import accumulator
from mpistrat.collectives.structure import leaf_names
from mpistrat.runtime.devices import array_kind, array_module, from_host

__all__ = ["as_array", "partial", "LazyNames", "restore", "same_shapes", "combine_local", "mean"]

_IDENTITY = {ReduceOp.MIN: "max", ReduceOp.MAX: "min"}


def as_array(value: Any):
    """``value`` as an array: CuPy arrays stay on their GPU, anything else goes to NumPy."""
    return value if array_kind(value) == "cupy" else np.asarray(value)


def partial(op: ReduceOp, array, axis: int):
    """This replica's contribution along ``axis``, in the dtype it combines in across ranks
    (``dtypes.accumulator``); an empty batch gives the identity (``MIN``/``MAX``: the
    extreme of the dtype, ``-inf``/``inf`` for floats, ``False``/``True`` for bool)."""
    xp = array_module(array)
    wide = accumulator(np.dtype(array.dtype), op)
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        return xp.sum(array, axis=axis, dtype=wide)
    boolean = array.dtype.char == "?"
    array = array.view(xp.uint8) if boolean else array.astype(wide, copy=False)
    if array.shape[axis] == 0:
        if boolean:
            fill = 1 if op is ReduceOp.MIN else 0
        elif wide.kind in "fc":
            fill = np.inf if op is ReduceOp.MIN else -np.inf
        else:
            fill = getattr(np.iinfo(wide), _IDENTITY[op])
        return xp.full(tuple(np.delete(array.shape, axis)), fill, dtype=wide)
    return (xp.min if op is ReduceOp.MIN else xp.max)(array, axis=axis)


class LazyNames:
    """The leaf paths of a value, computed only when an error names one."""

    def __init__(self, value):
        self._value, self._names = value, None

    def __getitem__(self, index: int) -> str:
        if self._names is None:
            self._names = leaf_names(self._value)
        return self._names[index] if index < len(self._names) else f"tensor {index}"


def restore(result, like):
    """``result`` in ``like``'s dtype, and as ``like``'s kind of array (JAX on its device)."""
    dtype = getattr(like, "dtype", None)
    dtype = np.dtype(dtype if dtype is not None else np.asarray(like).dtype)
    if result.dtype != dtype:
        result = result.view(np.bool_) if dtype.char == "?" and result.dtype == np.uint8 \
            else result.astype(dtype)
    if array_kind(like) == "jax" and array_kind(result) != "jax":
        return from_host(np.asarray(result), like)
    return result


def same_shapes(parts, replica_ids) -> None:
    """``ValueError`` unless this rank's replicas hold values of one shape."""
    shapes = {a.shape for a in parts}
    if len(shapes) > 1:
        described = "; ".join(f"replica {r}: {list(a.shape)}" for r, a in zip(replica_ids, parts))
        raise ValueError(f"reduce: the replicas of this rank have values of different shapes "
                         f"({described}); use axis=0 to reduce batches of different sizes")


def combine_local(op: ReduceOp, parts, replica_ids) -> np.ndarray:
    """Combine one tensor's values of this rank's replicas (equal shapes required), in the
    dtype they combine in across ranks for a SUM or MEAN (``dtypes.accumulator``)."""
    same_shapes(parts, replica_ids)
    if len(parts) == 1:  # (a SUM may wrap in its dtype, as NumPy's; a MEAN's sum may not)
        return parts[0] if op is not ReduceOp.MEAN else \
            parts[0].astype(accumulator(np.dtype(parts[0].dtype), op), copy=False)
    xp = array_module(parts[0])
    stacked = xp.stack(parts)
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        return xp.sum(stacked, axis=0, dtype=accumulator(np.dtype(stacked.dtype), op))
    return (xp.min if op is ReduceOp.MIN else xp.max)(stacked, axis=0)


def mean(total, count: int):
    """MEAN's division in the accumulator's dtype (integers truncate toward zero, as
    TensorFlow's ``Div``); the caller rounds once to the input's dtype."""
    result = array_module(total).array(total, copy=True)
    divide_for_mean(result, count)
    return result
