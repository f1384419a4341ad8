"""``out=``: an all-reduce that writes its results into buffers the caller owns.

TensorFlow's collectives return new tensors, and so does ``all_reduce``
without ``out``. Writing into new memory is what costs (docs/benchmarks.md:
out of place, every result line is fetched before it is written), so a
caller that owns its gradient buffers may pass ``out``, as with a NumPy
ufunc: ``out=value`` reduces in place (MPI's own in-place call where it is
fastest, and no packing copy for tensors of 64 KiB or more), other buffers
receive the results. ``out`` must match ``value`` exactly: one NumPy array
for an array, a list or tuple of as many for a list or tuple, each writable,
C-contiguous, of the same shape and dtype, and overlapping no other buffer
of the call but its own input. Every rank must pass the same kind of ``out``
(in place or not, tensor by tensor): the ranks agree on it as on the shapes.
``out_problem`` says what is wrong, or None::

    >>> import numpy as np
    >>> from mpistrat.collectives.out_buffers import out_problem
    >>> x = [np.ones(3), np.ones(2)]
    >>> out_problem(x, x) is None, out_problem(x, [x[0], np.ones(3)])
    (True, 'out[1] has shape (3,) and dtype float64; its input has shape (2,) and dtype float64')
"""

from typing import Any, List, Optional, Tuple

import numpy as np

__all__ = ["out_problem", "out_lists", "place_of", "same_buffer", "OUT_ALONE_BYTES"]

# Into ``out``, tensors of this size or more are reduced one by one, in their own buffers:
# MPI's per-tensor in-place call beat the packing copy from 64 KiB here (docs/benchmarks.md).
OUT_ALONE_BYTES = 64 << 10


def out_lists(value: Any, out: Any) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """``value`` and ``out`` as two lists (call ``out_problem`` first)."""
    if isinstance(value, np.ndarray):
        return [value], [out]
    return list(value), list(out)


# (NumPy 2 moved byte_bounds into numpy.lib.array_utils; NumPy 1 has it at the top)
_byte_bounds = getattr(getattr(np.lib, "array_utils", np), "byte_bounds", None) or \
    getattr(np, "byte_bounds")


def place_of(value: Any, out: Any) -> str:
    """How ``out`` (usable: ``out_problem`` found nothing) lies against ``value``: ``in
    place``, ``into other buffers``, or which tensors are in place. Part of what the ranks
    agree on, because the algorithm chosen for a tensor depends on it::

        >>> import numpy as np
        >>> x, y = np.ones(2), np.ones(3)
        >>> place_of([x, y], [x, np.empty(3)])
        'in place: tensors 0'
    """
    if out is value:
        return "in place"
    arrays, outs = out_lists(value, out)
    flags = [same_buffer(a, o) for a, o in zip(arrays, outs)]
    if all(flags):
        return "in place"
    if not any(flags):
        return "into other buffers"
    return "in place: tensors " + ",".join(str(i) for i, f in enumerate(flags) if f)


def out_problem(value: Any, out: Any) -> Optional[str]:
    """What makes ``out`` unusable for ``value`` (a text naming the buffer), or None."""
    if out is value and type(value) is list and _plain_in_place(value):
        return None   # (the usual call, ``out=grads``: checked in one pass)
    if isinstance(value, np.ndarray):
        if not isinstance(out, np.ndarray):
            return f"out must be a NumPy array for a NumPy array, got {type(out).__name__}"
    elif type(value) in (list, tuple):
        if not all(isinstance(v, np.ndarray) for v in value):
            kinds = sorted({type(v).__name__ for v in value if not isinstance(v, np.ndarray)})
            return f"out takes NumPy arrays only (the value holds {', '.join(kinds)})"
        if type(out) not in (list, tuple) or len(out) != len(value):
            return (f"out must be a list or tuple of {len(value)} NumPy arrays, got "
                    f"{type(out).__name__}" + (f" of {len(out)}" if type(out) in (list, tuple)
                                               else ""))
    else:
        return (f"out takes a NumPy array or a list or tuple of them, not a "
                f"{type(value).__name__} (nests, JAX and CuPy arrays are reduced into new "
                "arrays)")
    arrays, outs = out_lists(value, out)
    one = isinstance(value, np.ndarray)
    for index, (array, target) in enumerate(zip(arrays, outs)):
        name = "out" if one else f"out[{index}]"
        if type(target) is not np.ndarray:
            return f"{name} is a {type(target).__name__}, not a NumPy array"
        if target.shape != array.shape or target.dtype != array.dtype:
            return (f"{name} has shape {target.shape} and dtype {target.dtype}; its input "
                    f"has shape {array.shape} and dtype {array.dtype}")
        if not target.flags.writeable:
            return f"{name} is read-only"
        if not target.flags.c_contiguous:
            return f"{name} is not C-contiguous"
    return _overlap(arrays, outs, one)


def _plain_in_place(arrays: List) -> bool:
    """Whether a list reduced in place needs no closer look: distinct NumPy arrays that own
    their memory (so none overlaps another), each writable, aligned and C-contiguous."""
    for array in arrays:
        if type(array) is not np.ndarray or not array.flags.carray:
            return False
    return _distinct_owners(arrays)


def _distinct_owners(buffers: List[np.ndarray]) -> bool:
    """Whether ``buffers`` are distinct arrays that own their memory: none overlaps another."""
    return all(b.base is None for b in buffers) and len(set(map(id, buffers))) == len(buffers)


def _overlap(arrays: List[np.ndarray], outs: List[np.ndarray], one: bool) -> Optional[str]:
    """Which result would overwrite another buffer of the call, or None."""
    read = [a for a, o in zip(arrays, outs) if o is not a]
    buffers = outs + read
    if _distinct_owners(buffers):
        return None   # (the usual case)
    spans = []
    for index, (array, target) in enumerate(zip(arrays, outs)):
        if target.nbytes:
            spans.append((*_byte_bounds(target), index, "out"))
        if array.nbytes and not same_buffer(array, target):
            spans.append((*_byte_bounds(array), index, "input"))
    spans.sort()
    active: List[tuple] = []   # spans that reach past the current start (inputs may overlap)
    for span in spans:
        active = [a for a in active if a[1] > span[0]]
        for other in active:
            if "out" in (other[3], span[3]):
                return (f"{_named(other[2], other[3], one)} and {_named(span[2], span[3], one)}"
                        " overlap: a result would overwrite a value still to be read")
        active.append(span)
    return None


def same_buffer(array: np.ndarray, target: np.ndarray) -> bool:
    """Whether ``target`` is ``array``'s own memory, element for element (in place), for an
    ``out`` that ``out_problem`` accepted (equal shapes and dtypes, ``target`` C-contiguous)::

        >>> import numpy as np
        >>> x = np.ones(4)
        >>> same_buffer(x, x.reshape(1, 4)[0]), same_buffer(x, np.ones(4))
        (True, False)
    """
    return target is array or (target.ctypes.data == array.ctypes.data
                               and array.flags.c_contiguous)


def _named(index: int, what: str, one: bool) -> str:
    if one:
        return what if what == "out" else "the input"
    return f"out[{index}]" if what == "out" else f"input {index}"
