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
from mpistrat.collectives.backends.base import Backend, PlanCache, options_of
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

    def reduce_scatter(self, node_comm, send, recv, bounds, op, deadline):
        import cupy
        counts = [b - a for a, b in bounds]
        first, last = bounds[node_comm.Get_rank()]
        part = cupy.empty(last - first, send.dtype)
        _synchronise()
        if deadline is None:
            node_comm.Reduce_scatter(send, part, counts, op.mpi_op)
        else:
            wait_all([node_comm.Ireduce_scatter(send, part, counts, op.mpi_op)], deadline,
                     "hierarchical reduce-scatter")
        recv[first:last] = part
        _synchronise()

    def all_gather(self, node_comm, recv, bounds, deadline):
        counts = [b - a for a, b in bounds]
        first, last = bounds[node_comm.Get_rank()]
        part = recv[first:last].copy()
        _synchronise()
        spec = [recv, counts]
        if deadline is None:
            node_comm.Allgatherv(part, spec)
        else:
            wait_all([node_comm.Iallgatherv(part, spec)], deadline, "hierarchical all-gather")


_TRANSPORT = _DeviceMPITransport()


def _synchronise() -> None:
    import cupy
    cupy.cuda.get_current_stream().synchronize()


class CudaAwareMPI(Backend):
    """CuPy (and JAX GPU) buffers straight to a CUDA-aware MPI."""

    name = "cuda-aware-mpi"

    def __init__(self):
        self._plans = PlanCache()
        self._staged = StagedHostMPI()

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
        import cupy
        opts = options_of(options)
        if not all(on_cuda(a) for a in arrays):  # JAX arrays on CPU devices: staged
            return self._staged.all_reduce(comm, arrays, op, opts, deadline)
        preference = getattr(opts, "algorithm", "auto")
        size = comm.Get_size()
        originals, wires, buckets = device_buckets(arrays, op, opts, self._plans)
        _synchronise()  # MPI reads device memory outside CUDA's stream order
        results: List = [None] * len(arrays)
        for send, members in buckets:
            out = cupy.empty_like(send)
            topology = comm_topology(comm, deadline) if size > 1 else None
            algorithm = self.algorithm_for(send.nbytes, size, topology, preference)[0]
            if algorithm == "hierarchical":
                hierarchical.run(comm, send, out, op, deadline, _TRANSPORT)
            else:
                allreduce(comm, send, out, op, deadline, algorithm)
            if op is ReduceOp.MEAN:
                divide_on_device(out, size)
            device_unpack(out, members, originals, wires, results)
        return [from_cupy_like(r, a) for r, a in zip(results, arrays)]

    def all_gather(self, comm, arrays, counts, axis, deadline):
        import cupy
        if not all(on_cuda(a) for a in arrays):
            return self._staged.all_gather(comm, arrays, counts, axis, deadline)
        _synchronise()
        results = []
        for array, rows in zip(arrays, counts):
            value = as_cupy(array)
            front = cupy.ascontiguousarray(cupy.moveaxis(value, axis, 0))
            row_elems = int(np.prod(front.shape[1:], dtype=np.int64))
            gathered = cupy.empty((sum(rows),) + front.shape[1:], dtype=front.dtype)
            spec = [gathered, [r * row_elems for r in rows]]
            if deadline is None:
                comm.Allgatherv(front, spec)
            else:
                wait_all([comm.Iallgatherv(front, spec)], deadline, "all_gather")
            results.append(from_cupy_like(cupy.moveaxis(gathered, 0, axis), array))
        return results

    def broadcast(self, comm, arrays, root, deadline):
        import cupy
        if not all(on_cuda(a) for a in arrays):
            return self._staged.broadcast(comm, arrays, root, deadline)
        _synchronise()
        results = []
        for array in arrays:
            buffer = cupy.array(as_cupy(array), copy=True, order="C")
            cupy.cuda.get_current_stream().synchronize()
            if deadline is None:
                comm.Bcast(buffer, root=root)
            else:
                wait_all([comm.Ibcast(buffer, root=root)], deadline, "broadcast")
            results.append(from_cupy_like(buffer, array))
        return results
