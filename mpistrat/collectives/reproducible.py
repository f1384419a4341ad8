"""Reproducible sums: SUM and MEAN with the same bits whatever the order of addition.

Floating-point addition is not associative, so a sum depends on the rank
count, the algorithm (ring or MPI's tree), the fusion and, along an axis, on
how rows were split over ranks. Here each floating-point tensor is summed
exactly, as integers, on a fixed-point grid that every rank agrees on:

1. Each rank finds the binary exponent of its largest magnitude
   (``max_exponent``) and how many summands it adds per element (1, or its
   rows along the reduced axis). One ``Allgather`` of these small integers
   gives every rank the global exponent ``E`` (``max|x| < 2**E``) and the
   global summand count ``M``: both independent of how the data is split.
2. ``grid_for(dtype, E, M)`` picks the wire type and the fraction bits
   ``F``: each value ``x`` becomes ``q = trunc(x * 2**(F-E))`` with
   ``|q| < 2**F``, and ``M`` of them add up without overflow. For up to 7
   summands of float32/float64 the wire is the float itself: ``x`` is rounded
   onto the grid ``2**(E-F)`` with ``(x + C) - C`` (``C = 1.5 * 2**(E-F+p-1)``),
   and sums of such values are exact in the float while ``M * 2**E < 2**(E-F+p)``.
   One or two summands (``M <= 2``: two ranks element-wise, or two rows in
   all) need no grid at all: one float addition is commutative, so the float
   itself travels and the result is the exact sum rounded once. Element-wise
   at one or two ranks this skips step 1 too: ``M`` is the rank count.
3. ``to_fixed`` (summing rows along the axis in integers), an integer SUM
   across ranks (any algorithm, any fusion: integer addition is exact and
   associative), then ``from_fixed``: ``total * 2**(E-F)`` rounded once to
   the tensor's dtype.

Every step is a function of each element alone or an exact integer sum, so
the result is bitwise identical at any rank count, split, algorithm or order.

Accuracy: with one or two summands, the correctly rounded sum. Beyond, each
value is cut to the grid ``2**(E-F)`` (toward zero; to nearest on the float
wire), an error below one grid step, so
``|result - exact sum| < M * 2**(E-F)`` plus, on the integer wire, the final
rounding to the dtype (half an ulp of the result). On the integer wire ``F``
keeps at least the significand of the largest value (24 bits for float32, 11
for float16, 53 for float64 while ``M < 1024``; beyond that float64 keeps
``63 - bits(M)``); on the float wire (up to 7 summands) ``F`` is 21-22 bits
(float32) or 50-51 (float64), so even the largest values may lose their last
2 or 3 bits, about what one or two float additions lose. Values far smaller
than the largest lose low bits, as they would in any sum with it. Integer
tensors are summed as 64-bit integers (already exact). NaN or infinity
anywhere in a tensor makes that tensor fall back to the ordinary float sum
(the result is NaN or infinite either way; which NaN, its sign and payload,
may depend on the order, with one or two summands too: x86 keeps the first
operand's). float16, bfloat16 and the
``ml_dtypes`` float8 types are widened to float32 on the way in; a MEAN divides
in float32 (or the float itself) before the one rounding to the dtype, so a
float16 mean of 60000 and 60000 is 60000, not the infinity of their sum::

    >>> import numpy as np
    >>> from mpistrat.collectives.reproducible import grid_for, max_exponent, to_fixed, from_fixed
    >>> x = np.array([[0.1, 1e-8], [0.2, 3.0], [0.4, -1.0]], dtype=np.float32)
    >>> e = max_exponent(x); wire, f = grid_for(x.dtype, e, 3)
    >>> q = to_fixed(x, e, f, wire, axis=0)            # rows summed exactly
    >>> from_fixed(q, e, f, x.dtype)
    array([0.6999998, 2.       ], dtype=float32)
"""

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.dtypes import accumulator, is_low_float
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean
from mpistrat.runtime import settings

__all__ = ["DETERMINISTIC_ENV", "deterministic_default", "ZERO", "NONFINITE", "max_exponent", "grid_for", "to_fixed", "from_fixed",
           "exact_sum", "is_exact_kind"]

DETERMINISTIC_ENV = "MPISTRAT_DETERMINISTIC"
ZERO = -(1 << 30)       # exponent of an all-zero (or empty) tensor
NONFINITE = 1 << 30     # exponent of a tensor holding NaN or infinity
_SIGNIFICAND = {1: 11, 2: 11, 4: 24, 8: 53}   # bits kept, by float itemsize (float8: >= all)


def deterministic_default() -> bool:
    """Whether ``MPISTRAT_DETERMINISTIC`` turns reproducible sums on for every engine."""
    return settings.get(DETERMINISTIC_ENV)


def is_exact_kind(dtype) -> bool:
    """Whether ``dtype`` goes through the fixed-point path (floating point, real or complex)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "fc" or is_low_float(dtype)


def _real(array: np.ndarray) -> np.ndarray:
    """Complex values as pairs of reals (a view), real ones unchanged; float16, bfloat16 and
    float8 widened to float32 (whose range holds the scaled integers); native byte order."""
    if array.dtype.kind == "c":
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
        return array.view(array.real.dtype).reshape(array.shape + (2,))
    if is_low_float(array.dtype):
        return array.astype(np.float32)
    if not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="))
    return array


# Elements per block of a pass that reads a buffer twice (max then min; add then subtract):
# the second read hits the core's cache (256 KiB of float32).
_BLOCK = 1 << 16


def _max_min(flat: np.ndarray):
    """``(flat.max(), flat.min())``, block by block so the second pass reads from cache."""
    if flat.size <= _BLOCK:
        return flat.max(), flat.min()
    highs, lows = [], []
    for start in range(0, flat.size, _BLOCK):
        block = flat[start:start + _BLOCK]
        highs.append(block.max())
        lows.append(block.min())
    return np.max(highs), np.min(lows)   # (NumPy's: a NaN in any block propagates)


def max_exponent(array: np.ndarray) -> int:
    """``e`` with ``max|x| < 2**e`` (``ZERO`` if all zero or empty, ``NONFINITE``)."""
    array = _real(array)
    if array.size == 0:
        return ZERO
    return _exponent_of(*_max_min(array.reshape(-1)))


def _exponent_of(high, low) -> int:
    """``max_exponent`` of values whose largest is ``high`` and smallest ``low``."""
    if not (np.isfinite(high) and np.isfinite(low)):
        return NONFINITE
    biggest = max(float(high), -float(low))
    if biggest == 0.0:
        return ZERO
    return int(np.frexp(biggest)[1])


def _magic(wire: np.dtype, exponent: int, fraction_bits: int):
    """The constant ``C`` of the float wire's rounding ``(x + C) - C`` onto ``2**(E-F)``."""
    step = exponent - fraction_bits
    return wire.type(1.5 * 2.0 ** (step + _SIGNIFICAND[wire.itemsize] - 1))


def exponent_and_grid(array: np.ndarray, exponent: int, fraction_bits: int, wire):
    """``(max_exponent(array), to_fixed(array, exponent, fraction_bits, wire))`` for a float
    ``wire``, in one pass: each block is read from memory once, for its largest and smallest
    values, and rounded from cache. The grid is the one a guessed ``exponent`` gives; it is
    ``to_fixed``'s only where the exponent found (agreed over ranks) is that guess."""
    real = _real(np.asarray(array))
    wire = np.dtype(wire)
    magic = _magic(wire, exponent, fraction_bits)
    grid = np.empty(real.shape, wire)
    if real.size == 0:
        return ZERO, grid
    highs, lows = [], []
    _round_onto_grid(real.reshape(-1), grid.reshape(-1), magic, highs, lows)
    return _exponent_of(np.max(highs), np.min(lows)), grid


def _round_onto_grid(flat_in: np.ndarray, flat_out: np.ndarray, magic,
                     highs: Optional[list] = None, lows: Optional[list] = None) -> None:
    """``flat_out = (flat_in + C) - C`` block by block, so the subtraction reads from cache;
    with ``highs`` and ``lows``, each block's largest and smallest input value is noted
    first, from the same read."""
    for start in range(0, flat_out.size, _BLOCK):
        block, out = flat_in[start:start + _BLOCK], flat_out[start:start + _BLOCK]
        if highs is not None:
            highs.append(block.max())
            lows.append(block.min())
        np.add(block, magic, out=out)
        np.subtract(out, magic, out=out)


def grid_for(dtype, exponent: int, count: int) -> Tuple[np.dtype, int]:
    """``(wire dtype, fraction bits F)`` for ``count`` summands below ``2**exponent``.

    One or two summands need no grid (``F`` is None): the float itself travels
    (float32 for the narrow floats) and two values are added once, which gives
    the same bits in either order, the exact sum rounded once.
    Up to 7 summands of float32 or float64 (an element-wise all-reduce over a
    few ranks) stay floats: values rounded to ``F = p - max(bits(count), 2)``
    bits below the exponent (``p``: the significand, 24 or 53) add up exactly
    in the float itself, with no conversion (``F`` 21-22 or 50-51). Otherwise
    integers: int32 when it keeps the full significand of the largest value
    (float16, float32 with up to 127 summands), else int64::

        >>> grid_for(np.float16, 0, 2)
        (dtype('float32'), None)
        >>> grid_for(np.float32, 0, 4)
        (dtype('float32'), 21)
        >>> grid_for(np.float32, 0, 100)
        (dtype('int32'), 24)
        >>> grid_for(np.float32, 0, 1000)
        (dtype('int64'), 53)
    """
    dtype = np.dtype(dtype)
    itemsize = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    if count <= 2:   # one addition at most: commutative, so already the same in any order
        return np.dtype(f"f{max(itemsize, 4)}"), None
    need = _SIGNIFICAND.get(itemsize, 53)
    headroom = max(int(count), 1).bit_length()  # count < 2**headroom
    if itemsize >= 4 and headroom <= 3:
        real = np.dtype(f"f{itemsize}")
        bits = need - max(headroom, 2)
        step = exponent - bits  # the magic constant 1.5 * 2**(step + p - 1) must be normal
        info = np.finfo(real)
        if info.minexp <= step + need - 1 and step + need < info.maxexp:
            return real, bits
    if 31 - headroom >= need:
        return np.dtype(np.int32), 31 - headroom
    return np.dtype(np.int64), 63 - headroom


def _scaled(array: np.ndarray, shift: int, out: np.ndarray) -> np.ndarray:
    """``array * 2**shift`` in place of ``out`` (same float dtype): exact while the product
    is normal; ``ldexp`` when the power itself does not fit the dtype."""
    info = np.finfo(array.dtype)
    if info.minexp <= shift < info.maxexp:
        return np.multiply(array, array.dtype.type(2.0 ** shift), out=out)
    return np.ldexp(array, shift, out=out)


def _plain_rows(real: np.ndarray, axis: Optional[int]) -> np.ndarray:
    """What a rank sends of at most two summands: the values, or along ``axis`` its rows
    added once (none: ``-0.0``, the one float that adds without changing any value, the
    sign of a zero included)."""
    if axis is None:
        return real
    rows = real.shape[axis]
    if rows > 2:
        raise ValueError(f"{rows} rows along axis {axis}: a grid is needed beyond two summands")
    if rows == 0:
        return np.full(real.shape[:axis] + real.shape[axis + 1:], -0.0, dtype=real.dtype)
    first = np.take(real, 0, axis=axis)
    return first if rows == 1 else np.add(first, np.take(real, 1, axis=axis))


def to_fixed(array: np.ndarray, exponent: int, fraction_bits: int, wire,
             axis: Optional[int] = None) -> np.ndarray:
    """The integers ``trunc(x * 2**(F-E))``; with ``axis``, summed along it (exactly).

    Two passes over new memory: scale (exact), then cast to the integer type
    (truncation toward zero, a function of each value alone). On a float wire, the
    values rounded onto the grid ``2**(E-F)``; with ``F`` None (one or two summands),
    the values themselves.
    """
    array = np.asarray(array)
    if axis is not None:
        axis = axis % max(array.ndim, 1)
    real = _real(array)
    wire = np.dtype(wire)
    if fraction_bits is None:   # at most two summands (grid_for): the float itself
        return _plain_rows(real, axis)
    if exponent == ZERO:
        shape = real.shape if axis is None else np.delete(real.shape, axis % max(real.ndim, 1))
        return np.zeros(tuple(int(d) for d in shape), dtype=wire)
    if wire.kind == "f":  # round onto the grid in the float itself: (x + C) - C
        grid = np.empty(real.shape, wire)
        _round_onto_grid(real.reshape(-1), grid.reshape(-1), _magic(wire, exponent,
                                                                    fraction_bits))
        return grid if axis is None else np.sum(grid, axis=axis, dtype=wire)
    scaled = _scaled(real, fraction_bits - exponent, out=np.empty(real.shape, real.dtype))
    fixed = np.empty(real.shape, wire)
    np.copyto(fixed, scaled, casting="unsafe")
    del scaled
    return fixed if axis is None else np.sum(fixed, axis=axis, dtype=wire)


def from_fixed(total: np.ndarray, exponent: int, fraction_bits: int, dtype,
               divisor: int = 1) -> np.ndarray:
    """``total * 2**(E-F) / divisor`` in ``dtype``: one rounding of the exact integer sum
    (``divisor``, a MEAN's count, divides in float32 or wider first)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        real_dtype = np.dtype(f"f{dtype.itemsize // 2}")
    else:
        real_dtype = np.dtype(np.float32) if is_low_float(dtype) else dtype.newbyteorder("=")
    if exponent == ZERO and fraction_bits is not None:
        out = np.zeros(total.shape, dtype=real_dtype)
    elif total.dtype.kind == "f":  # summed on the grid in the float itself, or two values
        out = total.astype(real_dtype, copy=divisor != 1)
    else:
        out = np.empty(total.shape, real_dtype)
        np.copyto(out, total, casting="unsafe")  # the one rounding (exact for int32 -> f64)
        _scaled(out, exponent - fraction_bits, out=out)
    if divisor != 1:
        out /= divisor
    if dtype.kind == "c":
        out = np.ascontiguousarray(out).view(dtype.newbyteorder("=")).reshape(out.shape[:-1])
    return out.astype(dtype, copy=False)


def _remember(guesses: dict, key, exponent: int, count: int, wire: np.dtype, bits: int) -> None:
    """Keep an agreed exponent as the next call's guess, where it gives a float wire."""
    if bits is None or wire.kind != "f" or exponent == ZERO:
        guesses.pop(key, None)
        return
    if len(guesses) > 4096:
        guesses.clear()
    guesses[key] = (exponent, count, wire, bits)


def _agree(comm, arrays, exact, rows, axis, deadline, guesses):
    """Step 1 of ``exact_sum`` (but element-wise at one or two ranks): every tensor's agreed
    exponent and summand count (one small ``Allgather``), and the grids made on a guessed
    exponent, by index."""
    guessed = {}   # index -> (guessed exponent, guessed count, the grid made with them)
    found = []
    for index in exact:
        array = arrays[index]
        key = (index, array.dtype.str, array.shape)
        guess = guesses.get(key) if guesses is not None and axis is None else None
        if guess is None:
            found.append(max_exponent(array))
            continue
        exponent, count, wire, bits = guess
        mine_exponent, grid = exponent_and_grid(array, exponent, bits, wire)
        guessed[index] = (exponent, count, grid)
        found.append(mine_exponent)
    mine = np.array(found + rows, dtype=np.int64)
    table = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    if deadline is None:
        comm.Allgather(mine, table)
    else:  # a timed collective: the non-blocking call, as the engine's own
        wait_all([comm.Iallgather(mine, table)], deadline, "deterministic sum (exponents)")
    return (table[:, :len(exact)].max(axis=0).tolist(), table[:, len(exact):].sum(axis=0).tolist(),
            guessed)


def exact_sum(comm: MPI.Comm, arrays: Sequence[np.ndarray], axis: Optional[int],
              all_reduce_sum: Callable[[List[np.ndarray]], List[np.ndarray]],
              deadline: Optional[Deadline] = None,
              mean: bool = False,
              guesses: Optional[dict] = None) -> Tuple[List[np.ndarray], List[int]]:
    """Reproducible SUM of ``arrays`` over ``comm``: element-wise (``axis=None``) or of
    all rows along ``axis``. Returns the sums (``mean``: divided by the summand count
    before the one rounding; integers truncate toward zero) in each array's dtype, and each
    tensor's global summand count.

    ``all_reduce_sum(list)`` must SUM a list of arrays across ranks (it may fuse
    them); it is called once, with every tensor's integers and every integer tensor.

    ``guesses`` (a dict the caller keeps between calls): element-wise, a tensor whose
    previous call of the same place, dtype and shape agreed on an exponent and count that
    give a float wire is rounded with that exponent while its own is found
    (``exponent_and_grid``: one pass instead of two). Where the agreed exponent or count
    differ from the guess, the grid is made again with the agreed ones: the result is
    ``to_fixed``'s either way, bit for bit; a guess only saves a pass. Element-wise at one or
    two ranks neither is needed: the floats themselves are summed (``grid_for``).
    """
    arrays = [np.asarray(a) for a in arrays]
    exact = [i for i, a in enumerate(arrays) if is_exact_kind(a.dtype)]
    rows = [1 if axis is None else a.shape[axis] for a in arrays]
    if axis is None and comm.Get_size() <= 2:   # at most two summands: no grid (grid_for)
        exponents, counts, guessed = [ZERO] * len(exact), [comm.Get_size()] * len(arrays), {}
    else:
        exponents, counts, guessed = _agree(comm, arrays, exact, rows, axis, deadline, guesses)
    # 2. every tensor becomes the integers (or, for integer or non-finite tensors, the
    #    local partial sums) that travel
    position = {index: k for k, index in enumerate(exact)}
    grids = {}
    wires: List[np.ndarray] = []
    for index, array in enumerate(arrays):
        exponent = exponents[position[index]] if index in position else NONFINITE
        if index in position and (exponent != NONFINITE or counts[index] <= 2):
            wire, bits = grid_for(array.dtype, exponent, counts[index])
            grids[index] = (exponent, bits)
            guess = guessed.pop(index, None)
            if guess is not None and guess[:2] == (exponent, counts[index]):
                wires.append(guess[2])   # the guessed grid is the agreed one
            else:
                wires.append(to_fixed(array, exponent, bits, wire, axis))
            if guesses is not None and axis is None:
                _remember(guesses, (index, array.dtype.str, array.shape), exponent,
                          counts[index], wire, bits)
        else:  # integers in 64 bits (exact, and a MEAN of uint8 cannot wrap), floats wide
            wide = accumulator(array.dtype, ReduceOp.MEAN)
            wires.append(array.astype(wide, copy=False) if axis is None
                         else np.sum(array, axis=axis, dtype=wide))
    # 3. one integer SUM across ranks, then back to each dtype
    totals = all_reduce_sum(wires)
    results = []
    for index, (array, total) in enumerate(zip(arrays, totals)):
        if index in grids:
            exponent, bits = grids[index]
            results.append(from_fixed(np.asarray(total), exponent, bits, array.dtype,
                                      counts[index] if mean else 1))
        else:
            total = np.array(total, copy=True)
            if mean:
                divide_for_mean(total, counts[index])
            results.append(total.astype(array.dtype, copy=False))
    return results, counts
