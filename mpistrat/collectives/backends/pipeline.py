"""Staging device buffers through host memory, pipelined in chunks.

A large device buffer is cut into chunks. While the host all-reduces chunk
``i``, the copy stream brings chunk ``i + 1`` down and takes chunk ``i - 1``
back up, so the copies hide behind the reduction. The order of the work is a
pure function (``schedule``) and the driver (``run_pipeline``) talks to a
*stager* that owns the copies, so the logic runs on CPU with NumPy standing
for device memory (``NumpyStager``, whose copy stream is a worker thread)::

    >>> schedule(2)
    [('down', 0), ('down', 1), ('wait', 0), ('reduce', 0), ('up', 0), ('wait', 1), ('reduce', 1), ('up', 1)]
    >>> chunk_ranges(10, itemsize=4, chunk_bytes=16)
    [(0, 4), (4, 8), (8, 10)]

Host buffers are persistent: ``HostBufferPool`` hands out the same (pinned,
for CuPy) memory call after call instead of allocating per call.
"""

import concurrent.futures
import threading
from typing import Callable, Dict, List, Tuple

import numpy as np

__all__ = ["chunk_ranges", "schedule", "run_pipeline", "HostBufferPool", "NumpyStager",
           "STAGE_CHUNK_BYTES"]

# Chunks of this many bytes: large enough that each host all-reduce runs at full
# speed, small enough that a 256 MiB buffer has 8 chunks to overlap.
STAGE_CHUNK_BYTES = 32 << 20


def chunk_ranges(count: int, itemsize: int, chunk_bytes: int = STAGE_CHUNK_BYTES
                 ) -> List[Tuple[int, int]]:
    """Element ranges of at most ``chunk_bytes`` bytes covering ``count`` elements."""
    per = max(1, chunk_bytes // max(1, itemsize))
    return [(start, min(start + per, count)) for start in range(0, count, per)] or [(0, 0)]


def schedule(chunks: int) -> List[Tuple[str, int]]:
    """The order of work: copy down one chunk ahead, reduce, copy up.

    Every chunk is copied down before it is waited for, waited for before it
    is reduced, and reduced before it is copied up; chunk ``i + 1`` is
    copied down before chunk ``i`` is reduced (the overlap).
    """
    steps: List[Tuple[str, int]] = [("down", 0)] if chunks else []
    for i in range(chunks):
        if i + 1 < chunks:
            steps.append(("down", i + 1))
        steps += [("wait", i), ("reduce", i), ("up", i)]
    return steps


def run_pipeline(stager, device_src, device_dst, host: np.ndarray,
                 ranges: List[Tuple[int, int]], reduce_chunk: Callable[[np.ndarray], None]
                 ) -> None:
    """Stage ``device_src`` through ``host`` chunk by chunk into ``device_dst`` (flat arrays).

    ``reduce_chunk(view)`` combines one host chunk across ranks, in place.
    Every rank runs the same chunks in the same order, so the collectives match.
    """
    pending: Dict[int, object] = {}
    for step, i in schedule(len(ranges)):
        start, stop = ranges[i]
        if step == "down":
            pending[i] = stager.down(device_src, host, start, stop)
        elif step == "wait":
            stager.wait(pending.pop(i))
        elif step == "reduce":
            reduce_chunk(host[start:stop])
        else:
            stager.up(host, device_dst, start, stop)
    stager.finish()


class HostBufferPool:
    """One persistent host buffer per size class, grown when needed, reused across calls.

    ``allocate(nbytes)`` makes the memory (pinned for CuPy). A buffer is lent
    to one call at a time; a concurrent call gets a second buffer.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray]):
        self._allocate = allocate
        self._free: List[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocations = 0

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for index, buffer in enumerate(self._free):  # sorted by size: the smallest that fits
                if buffer.nbytes >= nbytes:
                    return self._free.pop(index)  # by position: arrays compare element-wise
        self.allocations += 1
        size = 1 << max(12, (nbytes - 1).bit_length())  # powers of two: few distinct sizes
        return self._allocate(size)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.nbytes)
            while sum(b.nbytes for b in self._free) > (2 << 30) and len(self._free) > 1:
                self._free.pop(0)  # keep at most ~2 GiB, dropping the smallest first


class NumpyStager:
    """NumPy arrays standing for device memory; a worker thread stands for the copy stream.

    Copies run in order on one thread, as on one CUDA stream; ``log`` records
    the order in which they ran (for tests).
    """

    def __init__(self, itemsize: int = 0):
        self._stream = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._last = None
        self.log: List[Tuple[str, int, int]] = []

    def _copy(self, what, dst, src, start, stop):
        def work():
            self.log.append((what, start, stop))
            np.copyto(dst, src)
        self._last = self._stream.submit(work)
        return self._last

    def down(self, device, host, start, stop):
        return self._copy("down", host[start:stop], device[start:stop], start, stop)

    def up(self, host, device, start, stop):
        return self._copy("up", device[start:stop], host[start:stop], start, stop)

    def wait(self, event) -> None:
        event.result()

    def finish(self) -> None:
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        self._stream.shutdown(wait=True)
