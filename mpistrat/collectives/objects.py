"""Small picklable metadata among ranks, under the collective timeout.

mpi4py's lowercase ``bcast``/``allgather`` block without limit: a rank that
stopped answering would hang the others. These do the same with nonblocking
calls waited on with the engine's deadline (``MPISTRAT_COLLECTIVE_TIMEOUT`` or
``CommunicationOptions.timeout_seconds``), so they end in
``DeadlineExceededError`` instead. For metadata only (tokens, offsets, file
views, failure texts), never array data; what is unpickled came from the
ranks of this job, never from a file::

    >>> from mpi4py import MPI
    >>> from mpistrat.collectives import CollectiveEngine
    >>> from mpistrat.collectives.objects import allgather_object, broadcast_object
    >>> engine = CollectiveEngine(MPI.COMM_SELF)
    >>> allgather_object(engine, {"rank": 0}, "views"), broadcast_object(engine, "token", 0, "t")
    ([{'rank': 0}], 'token')
"""

import pickle
from typing import Any, List

import numpy as np

from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.errors import AbortedError

__all__ = ["allgather_object", "broadcast_object", "gather_object", "deadline_of"]


def deadline_of(engine) -> "Deadline | None":
    """A deadline for one collective of ``engine`` (``None``: no timeout configured)."""
    if engine._broken:
        raise AbortedError(f"refused on rank {engine.rank}: {engine._broken}")
    return Deadline.after(engine.options.timeout_seconds)


def _wait(engine, requests, deadline, what: str) -> None:
    engine._guard(wait_all, requests, deadline, what)  # a timeout marks the engine broken


def allgather_object(engine, obj: Any, what: str) -> List[Any]:
    """Every rank's ``obj``, in rank order (collective, timed)."""
    if engine.size == 1:
        return [obj]
    deadline = deadline_of(engine)
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.empty(engine.size, dtype=np.int64)
    _wait(engine, [engine.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes)],
          deadline, f"{what} (sizes)")
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    _wait(engine, [engine.comm.Iallgatherv(data, [gathered, sizes.tolist()])], deadline, what)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [pickle.loads(gathered[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])]


def broadcast_object(engine, obj: Any, root: int, what: str) -> Any:
    """``root``'s ``obj`` on every rank (collective, timed)."""
    if engine.size == 1:
        return obj
    deadline = deadline_of(engine)
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8) \
        if engine.rank == root else None
    size = np.array([data.size if data is not None else 0], dtype=np.int64)
    _wait(engine, [engine.comm.Ibcast(size, root=root)], deadline, f"{what} (size)")
    buffer = np.array(data) if data is not None else np.empty(int(size[0]), dtype=np.uint8)
    _wait(engine, [engine.comm.Ibcast(buffer, root=root)], deadline, what)
    return obj if engine.rank == root else pickle.loads(buffer.tobytes())


def gather_object(engine, obj: Any, root: int, what: str) -> "List[Any] | None":
    """Every rank's ``obj`` in rank order on ``root``; ``None`` on the others (collective,
    timed)."""
    if engine.size == 1:
        return [obj]
    deadline = deadline_of(engine)
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.empty(engine.size, dtype=np.int64) if engine.rank == root else None
    _wait(engine, [engine.comm.Igather(np.array([data.size], dtype=np.int64), sizes, root=root)],
          deadline, f"{what} (sizes)")
    if engine.rank != root:
        _wait(engine, [engine.comm.Igatherv(data, None, root=root)], deadline, what)
        return None
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    _wait(engine, [engine.comm.Igatherv(data, [gathered, sizes.tolist()], root=root)],
          deadline, what)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [pickle.loads(gathered[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])]
