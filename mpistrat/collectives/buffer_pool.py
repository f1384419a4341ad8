"""Reusable result buffers, so that steady training loops do not fault in fresh pages.

A collective's results are new arrays. Allocating ~100 MB of fresh memory on
every step costs as much as the all-reduce itself here (the kernel zero-fills
each page on first touch). The pool keeps the memory of earlier results and
hands it out again once nothing refers to it any more: every array it gives
out is a view of a pooled *owner* array, so the owner's reference count tells
whether any result still uses it. Nothing is ever reused while referenced::

    >>> import numpy as np
    >>> from mpistrat.collectives.buffer_pool import BufferPool
    >>> pool = BufferPool(max_bytes=1 << 20)
    >>> a = pool.take((4,), np.float32)
    >>> address = a.__array_interface__["data"][0]
    >>> del a                                  # the result is dropped ...
    >>> b = pool.take((2, 2), np.float32)      # ... so its memory comes back
    >>> b.__array_interface__["data"][0] == address
    True
"""

import math
import sys
import threading
from typing import Dict, List

import numpy as np

from mpistrat.runtime import settings

__all__ = ["BufferPool", "default_pool"]

# References to a free owner while ``take`` checks it: the pool's list, the
# loop variable, and getrefcount's own argument.
_FREE_REFCOUNT = 3


class BufferPool:
    """Owners of reusable memory, by size in bytes, up to ``max_bytes`` held in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._owners: Dict[int, List[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, shape, dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` (reused memory when free)."""
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        # (math.prod of Python ints: exact, and a tenth of np.prod's cost on a short shape)
        nbytes = (shape if type(shape) is int else math.prod(shape)) * dtype.itemsize
        with self._lock:
            owners = self._owners.setdefault(nbytes, [])
            for owner in owners:
                if sys.getrefcount(owner) <= _FREE_REFCOUNT:
                    return owner.view(dtype).reshape(shape)
            owner = np.empty(nbytes, dtype=np.uint8)
            if self.held_bytes + nbytes <= self.max_bytes:
                owners.append(owner)
                self.held_bytes += nbytes
        return owner.view(dtype).reshape(shape)

    def clear(self) -> None:
        """Forget every pooled owner (results still in use stay valid)."""
        with self._lock:
            self._owners.clear()
            self.held_bytes = 0


_DEFAULT = BufferPool(settings.get("MPISTRAT_BUFFER_POOL_BYTES", at_import=True))


def default_pool() -> BufferPool:
    """The process-wide pool (``MPISTRAT_BUFFER_POOL_BYTES``, default 1 GiB; 0 disables)."""
    return _DEFAULT
