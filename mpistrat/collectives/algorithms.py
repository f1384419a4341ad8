"""All-reduce algorithms on contiguous host buffers.

Two algorithms, chosen by message size (``choose_algorithm``):

* ``mpi``: the MPI library's own ``Allreduce`` (best for small messages).
* ``ring``: reduce-scatter then all-gather around a ring of ``Sendrecv``
  calls. Each rank sends ``2 (n-1)/n`` of the buffer and reduces only
  ``(n-1)/n`` of it, which beats Open MPI 4.1's default for messages of a few
  MiB and more on our machines (docs/benchmarks.md).

The chunk layout is a pure function, ``ring_chunks``::

    >>> from mpistrat.collectives.algorithms import ring_chunks
    >>> ring_chunks(10, 3)
    [(0, 4), (4, 7), (7, 10)]
"""

import os
from typing import List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.buffer_pool import default_pool
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.partition import even_ranges
from mpistrat.runtime import timeline

__all__ = ["ring_chunks", "choose_algorithm", "allreduce", "RING_THRESHOLD_BYTES"]

# Messages of at least this many bytes use the ring (override with
# MPISTRAT_RING_THRESHOLD; a negative value turns the ring off).
RING_THRESHOLD_BYTES = int(os.environ.get("MPISTRAT_RING_THRESHOLD", str(1 << 20)))
_RING_TAG = 0x7269

_COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add,
            ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def ring_chunks(count: int, parts: int) -> List[Tuple[int, int]]:
    """The ring's chunks: ``count`` elements in ``parts`` contiguous ranges (``even_ranges``)."""
    return even_ranges(count, parts)


def choose_algorithm(nbytes: int, comm_size: int, threshold: int = RING_THRESHOLD_BYTES) -> str:
    """``"ring"`` for large messages on several ranks, else ``"mpi"``."""
    if comm_size > 1 and 0 <= threshold <= nbytes:
        return "ring"
    return "mpi"


def allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              deadline: Optional[Deadline], algorithm: str) -> None:
    """Combine ``send`` across ``comm`` into ``recv`` (both contiguous, same shape).

    ``send`` may be ``recv`` itself (in place). Each call is one bucket span
    of the timeline when it records.
    """
    if timeline.ON:
        start = timeline.now()
        _allreduce(comm, send, recv, op, deadline, algorithm)
        timeline.note_algorithm(algorithm, recv.nbytes, start)
        return
    _allreduce(comm, send, recv, op, deadline, algorithm)


def _allreduce(comm, send, recv, op, deadline, algorithm):
    if algorithm == "ring":
        _ring_allreduce(comm, send, recv, op, deadline)
        return
    if send is recv:
        send = MPI.IN_PLACE
    if deadline is None:
        comm.Allreduce(send, recv, op.mpi_op)
    else:
        wait_all([comm.Iallreduce(send, recv, op.mpi_op)], deadline, f"all_reduce {op.name}")


def _exchange(comm, send, dest, recv, source, deadline, what):
    if deadline is None:
        comm.Sendrecv(send, dest, _RING_TAG, recv, source, _RING_TAG)
    else:
        requests = [comm.Irecv(recv, source, _RING_TAG), comm.Isend(send, dest, _RING_TAG)]
        wait_all(requests, deadline, what)


def _ring_allreduce(comm, send, recv, op, deadline):
    size, rank = comm.Get_size(), comm.Get_rank()
    src, out = send.reshape(-1), recv.reshape(-1)
    if size == 1:
        out[...] = src
        return
    bounds = ring_chunks(src.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    scratch = default_pool().take((bounds[0][1] - bounds[0][0],), src.dtype)
    combine = _COMBINE[op]
    what = f"ring all_reduce {op.name}"
    # 1. Reduce-scatter: pass partial sums to the right; after size-1 steps
    #    this rank holds the complete result of chunk (rank + 1) % size.
    for step in range(size - 1):
        send_chunk, recv_chunk = (rank - step) % size, (rank - step - 1) % size
        a, b = bounds[send_chunk]
        c, d = bounds[recv_chunk]
        outgoing = src[a:b] if step == 0 else out[a:b]
        _exchange(comm, outgoing, right, scratch[:d - c], left, deadline, what)
        combine(src[c:d], scratch[:d - c], out=out[c:d])
    # 2. All-gather: pass the complete chunks around the ring, straight into place.
    for step in range(size - 1):
        send_chunk, recv_chunk = (rank + 1 - step) % size, (rank - step) % size
        a, b = bounds[send_chunk]
        c, d = bounds[recv_chunk]
        _exchange(comm, out[a:b], right, out[c:d], left, deadline, what)
