"""Scratch memory of the collectives, lent out by explicit lease; results are the caller's.

A collective's *results* are new arrays the caller owns (``np.empty``), never views of
memory we might hand out again. Fresh memory would cost as much as the all-reduce itself
here (the kernel zero-fills each page on first touch), so the first engine asks the C
allocator to keep freed memory for the next allocation (``runtime/allocator.py``): a
steady training loop's results reuse the pages its previous results freed, without us
tracking who still holds them.

*Scratch* (a ring's receive buffer, a conversion's mask) is ours: ``lease`` lends an array
for the duration of a ``with`` block and takes it back at its end, for the next lease of
the same size; a block that raised (a collective that timed out with a receive still
posted) drops its lease instead. Nothing is lent twice at once, and nothing the caller
received is ever reused::

    >>> import numpy as np
    >>> from mpistrat.collectives.buffer_pool import BufferPool
    >>> pool = BufferPool(max_bytes=1 << 20)
    >>> with pool.lease((4,), np.float32) as scratch:
    ...     address = scratch.__array_interface__["data"][0]
    >>> with pool.lease((2, 2), np.float32) as again:     # the same bytes, lent again
    ...     again.__array_interface__["data"][0] == address
    True
"""

import contextlib
import math
import os
import threading
from typing import Dict, Iterator, List, Optional

import numpy as np

from mpistrat.runtime import settings

__all__ = ["BufferPool", "default_pool", "default_cap"]


class BufferPool:
    """Scratch arrays lent by ``lease``, kept between leases up to ``max_bytes`` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._free: Dict[int, List[np.ndarray]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lease(self, shape, dtype) -> Iterator[np.ndarray]:
        """An uninitialised array of ``shape`` and ``dtype`` for the ``with`` block alone."""
        dtype = np.dtype(dtype)
        nbytes = (shape if type(shape) is int else math.prod(shape)) * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            owner = free.pop() if free else None
            if owner is not None:
                self.held_bytes -= nbytes
        if owner is None:
            owner = np.empty(nbytes, dtype=np.uint8)
        yield owner.view(dtype).reshape(shape)
        # (reached only when the block ended normally: after a failure, a timed-out receive
        # may still land in this memory, so it is dropped, never lent again)
        with self._lock:
            if self.held_bytes + nbytes <= self.max_bytes:
                self._free.setdefault(nbytes, []).append(owner)
                self.held_bytes += nbytes

    def clear(self) -> None:
        """Forget every kept array."""
        with self._lock:
            self._free.clear()
            self.held_bytes = 0


def default_cap() -> int:
    """``MPISTRAT_BUFFER_POOL_BYTES``, or when unset 1/32 of this machine's memory, at most
    1 GiB: 256 MiB on an 8 GiB laptop, 1 GiB on a node of 32 GiB or more."""
    given = settings.get("MPISTRAT_BUFFER_POOL_BYTES", at_import=True)
    if given is not None:
        return given
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return int(min(1 << 30, memory // 32))


_DEFAULT: Optional[BufferPool] = None


def default_pool() -> BufferPool:
    """The process-wide scratch pool (``default_cap`` bytes kept; 0 keeps none)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = BufferPool(default_cap())
    return _DEFAULT
