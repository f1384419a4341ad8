"""Freed memory kept by the C allocator, so fresh result arrays do not fault in new pages.

glibc returns a freed block larger than its mmap threshold to the kernel at once, and the
next allocation of that size gets fresh pages, zero-filled on first touch: for a training
loop's gradients, as slow as the all-reduce itself. ``keep_freed_memory(cap)`` raises the
mmap threshold and the trim threshold to ``cap`` (``mallopt``), so blocks up to ``cap`` come
from the heap and up to ``cap`` of freed memory stays there for the next allocation (glibc
before 2.35 takes an mmap threshold of at most 32 MiB: larger blocks are then mmap'ed as
before). This is process-wide: every allocation of the program below the threshold comes
from the heap, and up to ``cap`` bytes freed at the top of each heap stay with the process
(``MPISTRAT_BUFFER_POOL_BYTES=0`` leaves the allocator alone). Only with glibc, only once per
process, and never where the user set glibc's own variables (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``)::

    >>> keep_freed_memory(0)        # a cap of 0 changes nothing
    False
"""

import ctypes
import ctypes.util
import os
import threading

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_DONE = []
_LOCK = threading.Lock()


def keep_freed_memory(cap: int) -> bool:
    """Whether glibc now keeps freed blocks of up to ``cap`` bytes (``False``: left as is)."""
    if cap <= 0 or any(os.environ.get(v) for v in ("MALLOC_MMAP_THRESHOLD_",
                                                   "MALLOC_TRIM_THRESHOLD_")) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    with _LOCK:
        if _DONE:
            return _DONE[0]
        done = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None and hasattr(libc, "gnu_get_libc_version"):
                cap = int(min(cap, 1 << 30))
                # glibc before 2.35 refuses an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2):
                # then blocks up to 32 MiB are kept, larger ones still come from mmap
                done = any(mallopt(_M_MMAP_THRESHOLD, size) for size in
                           dict.fromkeys((cap, min(cap, 32 << 20))))
                if done:
                    mallopt(_M_TRIM_THRESHOLD, cap)
        except OSError:
            done = False
        _DONE.append(done)
        return done
