"""Helpers shared by the benchmarks: timing with barriers, and JSON output from rank 0."""

import json
import os
import sys
import time
from typing import Callable, Dict

from mpi4py import MPI


def best_seconds(comm: MPI.Comm, fn: Callable[[], object], repeats: int = 7,
                 inner: int = 1) -> float:
    """Minimum over ``repeats`` of the slowest rank's time for ``inner`` calls of ``fn``."""
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        elapsed = (time.perf_counter() - start) / inner
        best = min(best, comm.allreduce(elapsed, op=MPI.MAX))
    return best


def idle_barrier(comm: MPI.Comm, poll: float = 0.005) -> None:
    """A barrier that sleeps while it waits (``Ibarrier`` tested every ``poll`` s): ranks
    that wait for rank 0's one-process runs leave it the other cores (a ``Barrier`` polls)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


def emit(comm: MPI.Comm, record: Dict) -> None:
    """Print ``record`` as one JSON line on rank 0."""
    if comm.Get_rank() == 0:
        print(json.dumps(record), flush=True)
        sys.stdout.flush()


def drop_caches() -> bool:
    """Drop the page cache if permitted (root on Linux); return whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False
