"""Which dtypes each collective takes, and the dtype each one travels and combines in.

MPI reduces only its own types. Everything else is decided here, in one place:

* ``accumulator(dtype, op)``: the dtype a reduction combines in. Half precision,
  bfloat16 and every ``ml_dtypes`` float8/float6/float4 type combine in float32
  and are rounded once, at the end; integer ``MEAN`` sums in 64 bits (so 200 + 200
  + 200 in uint8 averages to 200, not to a wrapped 88 / 3); ``ml_dtypes`` small
  integers (int4, int2, ...) combine in int64; 8- and 16-bit integer ``SUM`` in 32 bits
  (Open MPI's vectorised SUM saturates them); bool travels as bytes (``MIN``/``MAX``
  only); a non-native byte order travels native. The result always comes back in
  the input's dtype: integer ``MEAN`` truncates toward zero (TensorFlow's ``Div``),
  integer ``SUM`` wraps as NumPy's arithmetic in that dtype does.
* ``refusal(dtype, op)``: why a reduction cannot take a dtype (``None`` if it can):
  complex ``MIN``/``MAX`` (no order a reduction could use), bool ``SUM``/``MEAN``,
  strings, bytes, objects, datetimes and structured records.
* ``raw_bits(dtype)``: the dtype a gather or broadcast moves bit for bit (types MPI
  lacks move as unsigned integers of their size, other fixed-size types as bytes).
* ``dtype_code(dtype)``: a short name every rank spells alike (``'<f4'``,
  ``'bfloat16'``): ``dtype.str`` alone cannot tell the float8 types apart.

    >>> import numpy as np, ml_dtypes
    >>> from mpistrat.collectives.dtypes import accumulator, refusal, dtype_code
    >>> from mpistrat.collectives.reduce_op import ReduceOp
    >>> accumulator(np.dtype(ml_dtypes.bfloat16), ReduceOp.SUM)
    dtype('float32')
    >>> accumulator(np.dtype(np.uint8), ReduceOp.MEAN)
    dtype('uint64')
    >>> accumulator(np.dtype(np.int16), ReduceOp.SUM)
    dtype('int32')
    >>> refusal(np.dtype(np.complex64), ReduceOp.MAX)[:40]
    'ReduceOp.MAX has no order for complex va'
    >>> dtype_code(np.dtype(ml_dtypes.float8_e4m3fn))
    'float8_e4m3fn'
"""

import functools
import operator
from typing import Callable, Optional, Sequence

import numpy as np

from mpistrat.collectives.buffer_pool import default_pool
from mpistrat.collectives.reduce_op import ReduceOp

__all__ = ["accumulator", "refusal", "raw_bits", "dtype_code", "is_low_float", "is_small_int",
           "is_foreign", "to_wire", "from_wire", "refuse",
           "MPI_CHARS", "check_reducible", "MEAN_DTYPE_RULE"]

MPI_CHARS = frozenset("?bBhHiIlLqQfdgFDG")  # NumPy types MPI moves and reduces natively
_F32 = np.dtype(np.float32)
_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
             8: np.dtype(np.uint64)}
_REFUSED_KINDS = {"O": "Python objects", "U": "strings", "S": "bytes", "M": "datetimes",
                  "m": "time deltas"}
MEAN_DTYPE_RULE = ("MEAN returns the input's dtype: floats divide in float32 or wider and round "
                   "once; integers sum in 64 bits and truncate toward zero")


def _from_ml_dtypes(dtype: np.dtype) -> bool:
    return getattr(dtype.type, "__module__", "") == "ml_dtypes"


def is_foreign(dtype) -> bool:
    """An ``ml_dtypes`` type: its one-letter code may be one of NumPy's own (``'L'``, ``'G'``),
    so a dtype's ``char`` alone never says MPI, CuPy or NCCL can take it."""
    return _from_ml_dtypes(np.dtype(dtype))


def is_low_float(dtype: np.dtype) -> bool:
    """float16, bfloat16 and the ``ml_dtypes`` float8/6/4 types: MPI reduces none of them."""
    if dtype.char == "e":
        return True
    return _from_ml_dtypes(dtype) and "float" in dtype.name


def is_small_int(dtype: np.dtype) -> bool:
    """The ``ml_dtypes`` sub-byte integers (int4, uint4, int2, ...)."""
    return _from_ml_dtypes(dtype) and "int" in dtype.name and "float" not in dtype.name


def dtype_code(dtype) -> str:
    """``dtype.str``, or the name for ``ml_dtypes`` types (whose ``str`` is ``'<V1'``/``'<V2'``)."""
    dtype = np.dtype(dtype)
    return dtype.name if _from_ml_dtypes(dtype) else dtype.str


@functools.lru_cache(maxsize=512)
def refusal(dtype: np.dtype, op: ReduceOp) -> Optional[str]:
    """Why ``op`` cannot reduce ``dtype`` values (``None`` when it can)."""
    kind = dtype.kind
    if kind in _REFUSED_KINDS:
        return f"ReduceOp.{op.name} cannot combine {_REFUSED_KINDS[kind]} ({dtype})"
    if kind == "V" and not (is_low_float(dtype) or is_small_int(dtype)):
        return f"ReduceOp.{op.name} cannot combine structured or raw records ({dtype})"
    if kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        return (f"ReduceOp.{op.name} has no order for complex values ({dtype}); reduce the "
                f"real and imaginary parts, or abs(), instead")
    if kind == "b" and op in (ReduceOp.SUM, ReduceOp.MEAN):
        return f"ReduceOp.{op.name} does not apply to bool tensors; use MIN or MAX"
    return None


@functools.lru_cache(maxsize=512)
def accumulator(dtype: np.dtype, op: Optional[ReduceOp]) -> np.dtype:
    """The dtype ``op`` combines ``dtype`` values in across ranks (see the module docstring).

    ``TypeError`` for what ``refusal`` refuses.
    """
    why = refusal(dtype, op) if op is not None else None
    if why is not None:
        raise TypeError(why)
    if dtype.char == "?":
        return _UNSIGNED[1]
    if is_low_float(dtype):
        return _F32
    if is_small_int(dtype):
        return np.dtype(np.uint64 if dtype.name.startswith("u") else np.int64)
    if op is ReduceOp.MEAN and dtype.kind in "iu" and dtype.itemsize < 8:
        return np.dtype(np.int64 if dtype.kind == "i" else np.uint64)
    if op is ReduceOp.SUM and dtype.kind in "iu" and dtype.itemsize < 4:
        # Open MPI 4.1's vectorised SUM (op/avx) saturates 8- and 16-bit integers from 8
        # values up (open-mpi/ompi#8045, wontfix) while shorter ones wrap: 32 bits wrap
        # everywhere, and their low bits are the wrapped sum in the dtype
        return np.dtype(np.int32 if dtype.kind == "i" else np.uint32)
    if not dtype.isnative:
        return dtype.newbyteorder("=")
    return dtype


def raw_bits(dtype: np.dtype) -> np.dtype:
    """The dtype that moves ``dtype`` values unchanged (gathers, broadcasts): the dtype itself
    where MPI has it, else unsigned integers of its size, else bytes (then the caller views
    each element as ``itemsize`` bytes). ``TypeError`` for Python objects."""
    if dtype.kind == "O":
        raise TypeError("Python objects (dtype object) cannot travel in a collective; pass "
                        "arrays of numbers (use broadcast_object for small metadata)")
    if dtype.char in MPI_CHARS and dtype.isnative and not _from_ml_dtypes(dtype):
        return dtype  # (ml_dtypes reuse NumPy's letters: float8_e4m3b11fnuz is 'L')
    return _UNSIGNED.get(dtype.itemsize, _UNSIGNED[1])


def check_reducible(what: str, arrays, op: ReduceOp, names=None) -> None:
    """``TypeError`` naming the first tensor ``op`` cannot reduce (``names[i]`` its path).

    Callers run it after the ranks agreed on the signature (dtypes and op), so every
    rank raises the same error together and none enters the collective alone.
    """
    for index, array in enumerate(arrays):
        why = refusal(np.dtype(array.dtype), op)
        if why is not None:
            name = names[index] if names is not None else f"tensor {index}"
            raise TypeError(f"{what}: {name}: {why}")


def _is_bfloat16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16" and _from_ml_dtypes(dtype)


def to_wire(array: np.ndarray, wire: np.dtype) -> np.ndarray:
    """``array`` as a contiguous ``wire`` buffer. bfloat16 widens by a bit shift (its bits
    are float32's upper half: exact, about twice as fast as ``astype``)."""
    if wire == _F32 and _is_bfloat16(array.dtype):
        out = np.empty(array.shape, np.uint32)
        bits = np.ascontiguousarray(array).view(np.uint16).reshape(array.shape)  # (0-d too)
        np.left_shift(bits, 16, out=out, dtype=np.uint32)
        return out.view(np.float32)
    if array.dtype.char == "?":  # (ascontiguousarray makes 0-d arrays 1-d: reshape back)
        return np.ascontiguousarray(array).view(np.uint8).reshape(array.shape)
    return np.ascontiguousarray(array, dtype=wire).reshape(array.shape)


_BLOCK = 1 << 15  # elements per block of the bfloat16 rounding (128 KiB of float32)


def from_wire(piece: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A combined ``piece`` rounded once back to ``dtype``. float32 to bfloat16 rounds to
    nearest even on the bits, as ``astype`` does, in about half its time (NaN stays NaN with
    its sign; its payload may differ). The result is a new array (the caller's)."""
    if dtype.char == "?":
        return piece.view(np.bool_)
    if not (_is_bfloat16(dtype) and piece.dtype == _F32 and piece.flags.c_contiguous):
        return piece.astype(dtype)
    shape, piece = piece.shape, piece.reshape(-1)  # (flat: 0-d arrays too)
    with default_pool().lease(piece.shape, np.bool_) as nan:
        np.isnan(piece, out=nan)
        where = np.flatnonzero(nan) if nan.any() else None
    quiet = ((piece.view(np.uint32)[where] >> 16) | 0x0040).astype(np.uint16) \
        if where is not None else None  # NaN keeps its sign and top payload, made quiet
    bits = piece.view(np.uint32)
    out = np.empty(bits.shape, np.uint16)
    odd, work = np.empty(_BLOCK, np.uint32), np.empty(_BLOCK, np.uint32)
    for start in range(0, bits.size, _BLOCK):  # blocks that stay in cache across the passes
        block = bits[start:start + _BLOCK]
        o, w = odd[:block.size], work[:block.size]
        np.right_shift(block, 16, out=o)
        np.bitwise_and(o, 1, out=o)
        o += 0x7FFF
        np.add(o, block, out=w)  # round to nearest, ties to even (a carry may reach inf)
        np.right_shift(w, 16, out=w)
        np.copyto(out[start:start + block.size], w, casting="unsafe")
    if quiet is not None:
        out[where] = quiet
    return out.view(dtype).reshape(shape)


_DTYPE_OF = operator.attrgetter("dtype")


def refuse(what: str, arrays, op: Optional[ReduceOp],
           names: Callable[[], Sequence[str]]) -> None:
    """``TypeError`` naming the first tensor this collective cannot take (``op``: a reduction;
    ``None``: a gather or broadcast, which moves bits; ``names()``: the arrays' names, asked
    for only on the error path). Runs after the ranks agreed on the
    signature (dtypes and op), so every rank raises together, before any data moves.
    Each distinct dtype is judged once (a list of 2000 float32 tensors: one judgement)."""
    refused = {}
    for dtype in set(map(_DTYPE_OF, arrays)):
        if op is None:
            if dtype.kind == "O":
                refused[dtype] = f"{dtype} values cannot travel in a collective; pass arrays " \
                                 f"of numbers"
        else:
            why = refusal(dtype, op)
            if why is not None:
                refused[dtype] = why
    if not refused:
        return
    for index, array in enumerate(arrays):   # (the error path: the first refused tensor)
        why = refused.get(array.dtype)
        if why is None:
            continue
        named = names()
        name = named[index] if len(named) == len(arrays) else f"tensor {index}"
        raise TypeError(f"{what}: {name}: {why}")
