"""Collective backends, kept in one ordered list; the first usable one runs.

Each backend answers ``usable(kind, implementation, caps)`` and implements
``all_reduce``, ``all_gather`` and ``broadcast`` on a list of arrays of one
kind. ``select_backend`` is the only place that chooses. Device buffers are
staged through host memory today: the GPU machine's MPI is not CUDA-aware
and NCCL refuses two ranks on one GPU (DESIGN.md section 5), so a direct
CUDA-aware or NCCL backend slots in here later, ahead of the staged one::

    >>> from mpistrat.collectives.backends import select_backend
    >>> from mpistrat.collectives.options import CommunicationImplementation as Impl
    >>> from mpistrat.runtime.devices import Capabilities
    >>> select_backend("numpy", Impl.AUTO, Capabilities(False, False)).name
    'host-mpi'
    >>> select_backend("cupy", Impl.AUTO, Capabilities(False, False)).name
    'staged-host-mpi'
"""

import functools
from typing import List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.algorithms import allreduce, choose_algorithm
from mpistrat.collectives.buffer_pool import default_pool
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.packing import fused_all_reduce
from mpistrat.collectives.options import CommunicationImplementation
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean
from mpistrat.runtime.devices import Capabilities, from_host, to_host

__all__ = ["Backend", "HostMPI", "StagedHostMPI", "BACKENDS", "select_backend"]

# Below this size a plain allocation is as cheap as the pool's bookkeeping.
_POOL_MIN_BYTES = 64 << 10


def _wire(array: np.ndarray, op: ReduceOp):
    """The contiguous buffer that travels for ``array`` (the array itself where possible)."""
    char = array.dtype.char
    if char == "?":
        if op is ReduceOp.SUM or op is ReduceOp.MEAN:
            raise TypeError(f"ReduceOp.{op.name} does not apply to bool tensors; use MIN or MAX")
        return np.ascontiguousarray(array).view(np.uint8)
    if char == "e":  # MPI has no half precision: such tensors travel as float32
        return np.ascontiguousarray(array, dtype=np.float32)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


class Backend:
    """One way to run collectives; subclasses keep the same anatomy."""

    name = "abstract"

    def usable(self, kind: str, implementation: CommunicationImplementation,
               caps: Capabilities) -> bool:
        raise NotImplementedError

    def all_reduce(self, comm: MPI.Comm, arrays: Sequence, op: ReduceOp, pack_bytes: int,
                   deadline: Optional[Deadline]) -> List:
        raise NotImplementedError

    def all_gather(self, comm: MPI.Comm, arrays: Sequence, counts: Sequence[Sequence[int]],
                   axis: int, deadline: Optional[Deadline]) -> List:
        raise NotImplementedError

    def broadcast(self, comm: MPI.Comm, arrays: Sequence, root: int,
                  deadline: Optional[Deadline]) -> List:
        raise NotImplementedError


class HostMPI(Backend):
    """NumPy buffers over MPI: small tensors fused by dtype, large ones reduced unpacked."""

    name = "host-mpi"

    def usable(self, kind, implementation, caps):
        return kind == "numpy"  # host arrays travel over MPI whatever the preference for devices

    def __init__(self):
        self._plans: dict = {}  # packing.FusedPlan per signature

    def all_reduce(self, comm, arrays, op, pack_bytes, deadline):
        if len(arrays) == 1:
            return [self._reduce_one(comm, arrays[0], op, deadline, comm.Get_size())]
        return fused_all_reduce(comm, arrays, op, pack_bytes, deadline, self._plans)

    def _reduce_one(self, comm, array, op, deadline, size):
        """One tensor: no plan, no packing (the common case of scalars and large tensors)."""
        original = array if type(array) is np.ndarray else np.asarray(array)
        wire = _wire(original, op)
        out = default_pool().take(wire.shape, wire.dtype) if wire.nbytes >= _POOL_MIN_BYTES \
            else np.empty_like(wire)
        allreduce(comm, wire, out, op, deadline, choose_algorithm(wire.nbytes, size))
        if op is ReduceOp.MEAN:
            divide_for_mean(out, size)
        if wire.dtype is not original.dtype:
            return out.view(np.bool_) if original.dtype.char == "?" else out.astype(original.dtype)
        return out

    def all_gather(self, comm, arrays, counts, axis, deadline):
        results = []
        for array, rows in zip(arrays, counts):
            array = np.asarray(array)
            # 1. bring the gather axis to the front, so each rank's block is contiguous
            front = np.ascontiguousarray(np.moveaxis(array, axis, 0))
            row_elems = int(np.prod(front.shape[1:], dtype=np.int64))
            gathered = np.empty((sum(rows),) + front.shape[1:], dtype=front.dtype)
            # 2. variable-count gather in rank order
            spec = [gathered, [r * row_elems for r in rows]]
            if deadline is None:
                comm.Allgatherv(front, spec)
            else:
                wait_all([comm.Iallgatherv(front, spec)], deadline, "all_gather")
            # 3. put the axis back where it was
            results.append(np.moveaxis(gathered, 0, axis))
        return results

    def broadcast(self, comm, arrays, root, deadline):
        results = []
        for array in arrays:
            buffer = np.array(array, copy=True, order="C")
            if deadline is None:
                comm.Bcast(buffer, root=root)
            else:
                wait_all([comm.Ibcast(buffer, root=root)], deadline, "broadcast")
            results.append(buffer)
        return results


class StagedHostMPI(Backend):
    """Device arrays (CuPy, JAX) copied to host, combined by ``HostMPI``, copied back."""

    name = "staged-host-mpi"
    _host = HostMPI()

    def usable(self, kind, implementation, caps):
        return kind in ("cupy", "jax") and implementation is not CommunicationImplementation.NCCL

    def _staged(self, method, arrays, *args):
        # 1. device -> host (pinned for CuPy); 2. host collective; 3. host -> device
        hosts = [to_host(a) for a in arrays]
        results = method(*args[:1], hosts, *args[1:])
        return [from_host(r, like) for r, like in zip(results, arrays)]

    def all_reduce(self, comm, arrays, op, pack_bytes, deadline):
        return self._staged(self._host.all_reduce, arrays, comm, op, pack_bytes, deadline)

    def all_gather(self, comm, arrays, counts, axis, deadline):
        return self._staged(self._host.all_gather, arrays, comm, counts, axis, deadline)

    def broadcast(self, comm, arrays, root, deadline):
        return self._staged(self._host.broadcast, arrays, comm, root, deadline)


BACKENDS: List[Backend] = [HostMPI(), StagedHostMPI()]


@functools.lru_cache(maxsize=64)
def select_backend(kind: str, implementation: CommunicationImplementation,
                   caps: Capabilities) -> Backend:
    """The first backend in ``BACKENDS`` that can serve ``kind`` arrays (cached per inputs)."""
    for backend in BACKENDS:
        if backend.usable(kind, implementation, caps):
            return backend
    raise ValueError(
        f"no collective backend serves {kind} arrays with implementation="
        f"{implementation.name}: NCCL is not implemented yet (use AUTO or MPI); tried "
        + ", ".join(b.name for b in BACKENDS))
