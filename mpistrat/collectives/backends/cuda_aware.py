"""``CudaAwareMPI``: device buffers handed to MPI directly, when MPI is CUDA-aware.

Used only when awareness was detected (Open MPI's ``MPIX_Query_cuda_support``)
or forced (``MPISTRAT_CUDA_AWARE_MPI=1``): a device pointer given to an MPI
without CUDA support crashes the rank. The producing stream is synchronised
before MPI reads the buffer, since MPI knows nothing of CUDA streams::

    >>> from mpistrat.collectives.backends.cuda_aware import CudaAwareMPI
    >>> from mpistrat.collectives.options import CommunicationImplementation as Impl
    >>> from mpistrat.runtime.devices import Capabilities
    >>> CudaAwareMPI().usable("cupy", Impl.AUTO, Capabilities(False, True))
    (False, 'MPI is not CUDA-aware (detected or MPISTRAT_CUDA_AWARE_MPI=0)')
"""

from typing import List

import numpy as np

from mpistrat.collectives.algorithms import allreduce, explain_algorithm
from mpistrat.collectives.backends import hierarchical
from mpistrat.collectives.backends.base import Backend, PlanCache, movable, options_of
from mpistrat.collectives.backends.staged import (StagedHostMPI, device_buckets,
                                                  device_unpack, divide_on_device, on_cuda)
from mpistrat.collectives.deadline import wait_all
from mpistrat.collectives.options import CommunicationImplementation
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.topology import comm_topology
from mpistrat.runtime.devices import as_cupy, from_cupy_like

__all__ = ["CudaAwareMPI"]


class _DeviceMPITransport(hierarchical.MPITransport):
    """The hierarchical steps on device buffers over a CUDA-aware MPI (its own collectives,
    which reduce on the device; our ring combines with host code)."""

    def __init__(self, xp):
        self.xp = xp

    def reduce_scatter(self, node_comm, send, recv, bounds, op, deadline):
        counts = [b - a for a, b in bounds]
        first, last = bounds[node_comm.Get_rank()]
        part = self.xp.empty(last - first, send.dtype)
        _synchronise(self.xp)
        if deadline is None:
            node_comm.Reduce_scatter(send, part, counts, op.mpi_op)
        else:
            wait_all([node_comm.Ireduce_scatter(send, part, counts, op.mpi_op)], deadline,
                     "hierarchical reduce-scatter")
        recv[first:last] = part
        _synchronise(self.xp)

    def all_gather(self, node_comm, recv, bounds, deadline):
        counts = [b - a for a, b in bounds]
        first, last = bounds[node_comm.Get_rank()]
        part = recv[first:last].copy()
        _synchronise(self.xp)
        spec = [recv, counts]
        if deadline is None:
            node_comm.Allgatherv(part, spec)
        else:
            wait_all([node_comm.Iallgatherv(part, spec)], deadline, "hierarchical all-gather")


def _synchronise(xp) -> None:
    """MPI reads device memory outside CUDA's stream order: finish the producing work first."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


class CudaAwareMPI(Backend):
    """CuPy (and JAX GPU) buffers straight to a CUDA-aware MPI.

    ``xp``: the array module of device memory (CuPy; NumPy stands for it in CPU tests).
    """

    name = "cuda-aware-mpi"

    def __init__(self, xp=None):
        self._plans = PlanCache()
        self._staged = StagedHostMPI()
        self._xp = xp

    @property
    def xp(self):
        if self._xp is None:
            import cupy
            self._xp = cupy
        return self._xp

    def _device(self, array):
        return array if self.xp is np else as_cupy(array)

    def _back(self, result, like):
        return result if self.xp is np else from_cupy_like(result, like)

    def _on_device(self, arrays) -> bool:
        return self.xp is np or all(on_cuda(a) for a in arrays)

    def usable(self, kind, implementation, caps, topology=None):
        if kind == "numpy":
            return False, "host arrays go to host MPI"
        if implementation is CommunicationImplementation.NCCL:
            return False, "implementation=NCCL asks for NCCL"
        if not caps.cuda_aware_mpi:
            return False, "MPI is not CUDA-aware (detected or MPISTRAT_CUDA_AWARE_MPI=0)"
        if not caps.cupy:
            return False, "CuPy is not installed (device buffers are handled through CuPy)"
        return True, "MPI is CUDA-aware: device buffers go to MPI without staging"

    def algorithm_for(self, nbytes, size, topology=None, preference="auto"):
        algorithm, why = explain_algorithm(nbytes, size, topology=topology, preference=preference)
        if algorithm == "ring":  # the ring combines chunks on the host
            return "mpi", "CUDA-aware MPI's own Allreduce reduces on the device"
        return algorithm, why

    def all_reduce(self, comm, arrays, op, options, deadline):
        xp, opts = self.xp, options_of(options)
        if not self._on_device(arrays):  # JAX arrays on CPU devices: staged
            return self._staged.all_reduce(comm, arrays, op, opts, deadline)
        preference = getattr(opts, "algorithm", "auto")
        size = comm.Get_size()
        originals, wires, buckets = device_buckets(arrays, op, opts, self._plans, xp=xp)
        _synchronise(xp)
        results: List = [None] * len(arrays)
        for send, members in buckets:
            out = xp.empty_like(send)
            topology = comm_topology(comm, deadline) if size > 1 else None
            algorithm = self.algorithm_for(send.nbytes, size, topology, preference)[0]
            if algorithm == "hierarchical":
                hierarchical.run(comm, send, out, op, deadline, _DeviceMPITransport(xp))
            else:
                allreduce(comm, send, out, op, deadline, algorithm)
            if op is ReduceOp.MEAN:
                divide_on_device(out, size, xp)
            device_unpack(out, members, originals, wires, results, xp)
        return [self._back(r, a) for r, a in zip(results, arrays)]

    def all_gather(self, comm, arrays, counts, axis, deadline):
        xp = self.xp
        if not self._on_device(arrays):
            return self._staged.all_gather(comm, arrays, counts, axis, deadline)
        _synchronise(xp)
        results = []
        for array, rows in zip(arrays, counts):
            front = xp.ascontiguousarray(xp.moveaxis(self._device(array), axis, 0))
            row_elems = int(np.prod(front.shape[1:], dtype=np.int64))
            gathered = xp.empty((sum(rows),) + front.shape[1:], dtype=front.dtype)
            _synchronise(xp)
            spec = [movable(gathered), [r * row_elems for r in rows]]
            if deadline is None:
                comm.Allgatherv(movable(front), spec)
            else:
                wait_all([comm.Iallgatherv(movable(front), spec)], deadline, "all_gather")
            results.append(self._back(xp.moveaxis(gathered, 0, axis), array))
        return results

    def broadcast(self, comm, arrays, root, deadline):
        xp = self.xp
        if not self._on_device(arrays):
            return self._staged.broadcast(comm, arrays, root, deadline)
        results = []
        for array in arrays:
            buffer = xp.array(self._device(array), copy=True, order="C")
            _synchronise(xp)
            if deadline is None:
                comm.Bcast(movable(buffer), root=root)
            else:
                wait_all([comm.Ibcast(movable(buffer), root=root)], deadline, "broadcast")
            results.append(self._back(buffer, array))
        return results
