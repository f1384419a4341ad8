"""Horovod's world: ``init``/``shutdown`` and the facts of the job (``rank``, ``size``,
``local_rank``, ``cross_size``, what MPI, Gloo and NCCL offer), the process sets (the global
one only) and the two errors of Horovod's API.

``init()`` makes one ``MultiWorkerMirroredStrategy`` over every rank; everything else in
``mpistrat.horovod`` reaches the world and the collective engine through it, so a call before
``init()`` or after ``shutdown()`` raises ``NotInitializedError``::

    import mpistrat.horovod as hvd
    hvd.init()
    print(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_size())
"""

from typing import Any


class NotSupportedError(NotImplementedError, ValueError):
    """What Horovod offers and ``mpistrat.horovod`` does not (``op=Adasum``, process sets
    other than the global one, ``hvd.elastic``): refused by name, on every rank that calls
    it."""


class NotInitializedError(ValueError):
    """A call that needs ``hvd.init()`` before it, or after ``hvd.shutdown()`` (a
    ``ValueError``, the class Horovod raises there, with Horovod's first sentence)."""


class ProcessSet:
    """Horovod's process set. Only the global one (every rank, ``global_process_set``) is
    supported: collectives refuse any other with ``NotSupportedError``."""

    def __init__(self, ranks: Any = None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def size(self) -> int:
        return size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return rank() if self.ranks is None else self.ranks.index(rank())

    def included(self) -> bool:
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        return "global_process_set" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set: Any) -> Any:
    """Refused: only the global process set is supported."""
    raise NotSupportedError(f"hvd.add_process_set({process_set!r}): mpistrat.horovod runs "
                            f"every collective over every rank (global_process_set only)")


def remove_process_set(process_set: Any) -> bool:
    """Refused: only the global process set is supported."""
    raise NotSupportedError(f"hvd.remove_process_set({process_set!r}): mpistrat.horovod runs "
                            f"every collective over every rank (global_process_set only)")


_STATE: dict = {}


def init(comm: Any = None) -> None:
    """Start (collective): the world and a ``MultiWorkerMirroredStrategy`` over every rank.
    ``comm`` other than the whole world is not supported. A second ``init()`` does nothing
    (as Horovod's); after ``shutdown()`` it starts again."""
    if comm is not None:
        raise NotSupportedError("hvd.init(comm=...): mpistrat.horovod runs over every rank "
                                "of the job; call hvd.init()")
    if "strategy" not in _STATE:
        from mpistrat.distribute.mirrored import MultiWorkerMirroredStrategy
        _STATE["strategy"] = MultiWorkerMirroredStrategy()
        _STATE.pop("shut_down", None)


def shutdown() -> None:
    """Stop using Horovod's API on this rank (local, no collective): ``is_initialized()`` is
    then ``False``, and ``rank()``, ``size()``, the collectives and ``join()`` raise
    ``NotInitializedError`` until ``init()`` again. MPI is not finalized (it ends with the
    process, so ``init()`` may start again). A model compiled with ``DistributedOptimizer``
    before keeps the strategy it was given."""
    if "strategy" in _STATE:
        _STATE.clear()
        _STATE["shut_down"] = True


def is_initialized() -> bool:
    """Whether ``init()`` ran on this rank and no ``shutdown()`` came after it."""
    return "strategy" in _STATE


def _strategy():
    if "strategy" not in _STATE:
        after = " (hvd.shutdown() was called since; hvd.init() starts again)" \
            if _STATE.get("shut_down") else ""
        raise NotInitializedError(f"Horovod has not been initialized; use hvd.init().{after}")
    return _STATE["strategy"]


def _world():
    _strategy()
    from mpistrat.runtime import get_world
    return get_world()


def rank() -> int:
    """This process's rank among all (``hvd.rank()``)."""
    return _world().rank


def size() -> int:
    """The number of ranks (``hvd.size()``)."""
    return _world().size


def local_rank() -> int:
    """This rank's index on its node: pick a GPU with it."""
    return _world().local_rank


def local_size() -> int:
    """The number of ranks on this rank's node."""
    return _world().local_size


def cross_rank() -> int:
    """The index of this rank's node."""
    return _world().node_index


def cross_size() -> int:
    """The number of nodes."""
    return _world().num_nodes


def mpi_threads_supported() -> bool:
    """Whether MPI runs at ``MPI_THREAD_MULTIPLE`` (``MPI.Query_thread()``), so that other
    MPI code (``mpi4py``) may run beside the collectives on other threads. Needs ``init()``,
    as Horovod's."""
    _strategy()
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """``True``: MPI runs the job and its collectives (NCCL may carry device arrays)."""
    return True


def mpi_built() -> bool:
    """``True``: mpistrat runs over MPI (``mpi4py``)."""
    return True


def gloo_enabled() -> bool:
    """``False``: there is no Gloo controller; MPI carries everything."""
    return False


def gloo_built() -> bool:
    """``False``: mpistrat has no Gloo."""
    return False


def nccl_built() -> int:
    """NCCL's version code (``cupy.cuda.nccl.get_version()``, e.g. ``21803``) when the NCCL
    backend can be used for device arrays (CuPy with NCCL imports, ``MPISTRAT_NCCL`` is not
    0), else ``0``: Horovod's convention (the code of the NCCL it was built with, or 0)."""
    from mpistrat.runtime.devices import nccl_available
    if not nccl_available()[0]:
        return 0
    from cupy.cuda import nccl
    return int(nccl.get_version())


def _engine():
    return _strategy().extended.engine
