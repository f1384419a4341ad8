"""``NcclBackend``: CuPy (and JAX GPU) arrays through NCCL, via ``from cupy.cuda import nccl``.

One NCCL communicator per engine communicator, made on the first device
collective (after the device is bound): rank 0's unique id is broadcast over
MPI, every rank joins, and the outcome is agreed over MPI, so an init failure
raises ``NcclInitError`` on every rank naming the ranks and NCCL's message
(two ranks on one GPU get a hint). Calls run on the caller's stream:
without a timeout the host never waits; with one, the host polls an event
and NCCL's asynchronous error, and past the deadline aborts the
communicator and raises ``DeadlineExceededError``.

Small tensors are fused into one device buffer per dtype; the buckets go in
one NCCL group. Half precision is reduced natively, bool as bytes (MIN/MAX);
dtypes NCCL lacks (int16, complex) go to the staged backend. All-gather of
uneven sizes is a group of broadcasts; broadcast and all-gather move bytes,
so every dtype works. Across nodes whose ranks share a GPU (simulated nodes
on one machine) the hierarchical algorithm runs NCCL inside each node and
MPI across::

    >>> from mpistrat.collectives.backends.nccl import NcclBackend
    >>> from mpistrat.collectives.options import CommunicationImplementation as Impl
    >>> from mpistrat.runtime.devices import Capabilities
    >>> NcclBackend().usable("cupy", Impl.AUTO, Capabilities(False, False, True))
    (False, 'NCCL is unavailable (cupy.cuda.nccl does not import)')
"""

import threading
import time
from typing import List, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.backends import hierarchical
from mpistrat.collectives.backends.base import Backend, PlanCache, options_of, wire_dtype
from mpistrat.collectives.backends.host import host_allreduce
from mpistrat.collectives.backends.staged import (StagedHostMPI, device_buckets, device_unpack,
                                                  divide_on_device, on_cuda)
from mpistrat.collectives.deadline import Deadline, idle
from mpistrat.collectives.options import CommunicationImplementation
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.topology import comm_topology
from mpistrat.errors import DeadlineExceededError, UnavailableError
from mpistrat.runtime.devices import as_cupy, from_cupy_like

__all__ = ["NcclBackend", "NcclInitError", "NcclComm", "nccl_comm", "NCCL_DTYPES", "init_hint"]

# NumPy dtype characters NCCL reduces (numbers from nccl.h; bool travels as uint8).
NCCL_DTYPES = {"b": 0, "B": 1, "?": 1, "i": 2, "I": 3, "l": 4, "L": 5, "q": 4, "Q": 5,
               "e": 6, "f": 7, "d": 8}
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.MEAN: 0, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
_UINT8 = 1


class NcclInitError(UnavailableError):
    """NCCL could not make its communicator; raised on every rank of the communicator."""


def init_hint(messages: List[Optional[str]], shared: bool) -> str:
    """The advice added to an init failure (pure: ``messages[r]`` is rank r's error or None).

    >>> init_hint(["ncclInvalidUsage: Duplicate GPU detected", None], False)[:40]
    'two ranks of this communicator use one G'
    """
    if shared or any(m and "Duplicate GPU" in m for m in messages):
        return ("two ranks of this communicator use one GPU, which NCCL refuses: give each rank "
                "its own GPU (CUDA_VISIBLE_DEVICES, Slurm --gpus-per-task) or use "
                "CommunicationImplementation.AUTO or MPI, which stage through host memory")
    return "check NCCL_DEBUG=INFO output, the network interfaces (NCCL_SOCKET_IFNAME) and the GPUs"


class NcclComm:
    """An NCCL communicator matching an MPI communicator rank for rank."""

    def __init__(self, comm: MPI.Comm, deadline: Optional[Deadline], shared: bool):
        import cupy
        from cupy.cuda import nccl  # CuPy 14: the attribute exists only after this import
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device = cupy.cuda.Device().id
        unique_id = None
        if self.rank == 0:  # a failure here is broadcast too: nobody waits for an id in vain
            try:
                unique_id = nccl.get_unique_id()
            except Exception as err:
                unique_id = f"ncclGetUniqueId failed on rank 0: {type(err).__name__}: {err}"
        unique_id = comm.bcast(unique_id, root=0)  # 128 bytes of metadata, once
        if isinstance(unique_id, str):
            made, error = None, unique_id
        else:
            made, error = _init(nccl, self.size, unique_id, self.rank, self.device, deadline)
        errors = comm.allgather(error)
        if any(errors):
            if made is not None:
                made.abort()
            failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(errors) if m)
            raise NcclInitError(f"NCCL could not start its communicator of {self.size} ranks "
                                f"(this is rank {self.rank}, GPU {self.device}): {failed}. "
                                f"{init_hint(errors, shared)}")
        self.nccl = made
        self.aborted = False

    def stream(self) -> int:
        import cupy
        return cupy.cuda.get_current_stream().ptr

    def wait(self, deadline: Optional[Deadline], what: str) -> None:
        """Poll until the enqueued work is done; past the deadline abort and raise."""
        if deadline is None:
            return  # stream-ordered: later work on this stream sees the results
        import cupy
        event = cupy.cuda.Event(disable_timing=True)
        event.record()
        started = time.monotonic()
        while not event.done:
            self.nccl.check_async_error()
            if deadline.expired():
                self.abort()
                raise DeadlineExceededError(
                    f"{what} (NCCL) did not complete within timeout_seconds={deadline.seconds:g} "
                    f"on rank {self.rank}: another rank did not join it; the NCCL communicator "
                    f"was aborted and this engine refuses further collectives")
            idle(started)

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.nccl.abort()


def _init(nccl, size, unique_id, rank, device, deadline):
    """``(communicator, None)`` or ``(None, message)``; a thread keeps a deadline honoured."""
    outcome: list = [None, None]

    def make():
        import cupy
        try:
            with cupy.cuda.Device(device):
                outcome[0] = nccl.NcclCommunicator(size, unique_id, rank)
        except Exception as err:  # NcclError and friends: reported to every rank
            outcome[1] = f"{type(err).__name__}: {err}"

    if deadline is None:
        make()
        return tuple(outcome)
    worker = threading.Thread(target=make, name="mpistrat-nccl-init", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline.at - time.monotonic()))
    if worker.is_alive():
        return None, f"ncclCommInitRank did not finish within {deadline.seconds:g} s"
    return tuple(outcome)


_KEYVAL = MPI.Comm.Create_keyval()


def nccl_comm(comm: MPI.Comm, deadline: Optional[Deadline] = None) -> NcclComm:
    """The NCCL communicator of ``comm``, made on first use (collective then)."""
    found = comm.Get_attr(_KEYVAL)
    if found is None or found.aborted:
        if found is not None:
            raise UnavailableError(f"the NCCL communicator of rank {comm.Get_rank()} was "
                                   f"aborted after a timeout; restart the job")
        found = NcclComm(comm, deadline, comm_topology(comm, deadline).gpu_shared_in_node)
        comm.Set_attr(_KEYVAL, found)
    return found


class _NcclTransport(hierarchical.MPITransport):
    """Hierarchical steps 1 and 3 with NCCL inside the node; step 2 staged over MPI."""

    def reduce_scatter(self, node_comm, send, recv, bounds, op, deadline):
        from cupy.cuda import nccl
        ncomm = nccl_comm(node_comm, deadline)
        dtype, stream, item = NCCL_DTYPES[send.dtype.char], ncomm.stream(), send.itemsize
        counts = [b - a for a, b in bounds]
        first = bounds[ncomm.rank][0]
        if len(set(counts)) == 1 and bounds[0][0] == 0:
            ncomm.nccl.reduceScatter(send.data.ptr, recv.data.ptr + first * item, counts[0],
                                     dtype, _NCCL_OPS[op], stream)
        else:  # uneven parts: one reduce to each part's owner, in one group
            nccl.groupStart()
            for root, (a, b) in enumerate(bounds):
                if b > a:
                    ncomm.nccl.reduce(send.data.ptr + a * item, recv.data.ptr + a * item, b - a,
                                      dtype, _NCCL_OPS[op], root, stream)
            nccl.groupEnd()
        ncomm.wait(deadline, "hierarchical reduce-scatter")

    def cross_allreduce(self, cross_comm, piece, op, deadline):
        host = piece.get()  # waits for the stream: the piece is complete
        wire = host.astype(wire_dtype(host.dtype, op))  # MPI has no half precision
        host_allreduce(cross_comm, wire, wire, op, deadline, "mpi")
        piece.set(wire.astype(host.dtype, copy=False))

    def all_gather(self, node_comm, recv, bounds, deadline):
        ncomm = nccl_comm(node_comm, deadline)
        _gather_in_place(ncomm, recv, bounds)
        ncomm.wait(deadline, "hierarchical all-gather")


def _gather_in_place(ncomm: NcclComm, buffer, bounds) -> None:
    """All-gather in place of flat ``buffer``: rank r contributes ``buffer[bounds[r]]``; as
    bytes, so any dtype and uneven parts work (a group of broadcasts when uneven)."""
    from cupy.cuda import nccl
    item, stream, base = buffer.itemsize, ncomm.stream(), buffer.data.ptr
    counts = [b - a for a, b in bounds]
    if len(set(counts)) == 1:
        first = bounds[ncomm.rank][0]
        ncomm.nccl.allGather(base + first * item, base, counts[0] * item, _UINT8, stream)
        return
    nccl.groupStart()
    for root, (a, b) in enumerate(bounds):
        if b > a:
            ncomm.nccl.broadcast(base + a * item, base + a * item, (b - a) * item, _UINT8, root,
                                 stream)
    nccl.groupEnd()


class NcclBackend(Backend):
    """CUDA arrays through NCCL (fused, grouped, stream-ordered)."""

    name = "nccl"

    def __init__(self):
        self._plans = PlanCache()
        self._staged = StagedHostMPI()

    def usable(self, kind, implementation, caps, topology=None):
        if kind == "numpy":
            return False, "host arrays go to host MPI"
        if not caps.nccl:
            return False, "NCCL is unavailable (cupy.cuda.nccl does not import)"
        if not caps.cupy:
            return False, "CuPy sees no GPU"
        if implementation is CommunicationImplementation.MPI:
            return False, "implementation=MPI asks for MPI"
        if implementation is CommunicationImplementation.NCCL:
            return True, "implementation=NCCL"
        if topology is not None and topology.gpu_shared_in_node:
            return False, ("two ranks of a node share one GPU, which NCCL refuses "
                           "(Duplicate GPU detected)")
        return True, "NCCL is available and every rank of each node has its own GPU"

    def algorithm_for(self, nbytes, size, topology=None, preference="auto"):
        if size == 1:
            return "nccl", "one rank"
        if preference == "hierarchical":
            return "hierarchical", "asked for (hierarchical) by cross_device_ops"
        if topology is not None and topology.gpu_shared and not topology.gpu_shared_in_node:
            return "hierarchical", ("ranks on different (simulated) nodes share a GPU: NCCL "
                                    "inside each node, MPI across")
        if preference == "reduce_broadcast":
            return "reduce_broadcast", "asked for (reduce_broadcast) by cross_device_ops"
        return "nccl", "NCCL's own ring/tree (topology-aware inside and across nodes)"

    def all_reduce(self, comm, arrays, op, options, deadline):
        import cupy
        from cupy.cuda import nccl
        opts = options_of(options)
        if not all(on_cuda(a) for a in arrays):  # JAX arrays on CPU devices: staged
            return self._staged.all_reduce(comm, arrays, op, opts, deadline)
        if op in (ReduceOp.SUM, ReduceOp.MEAN) and any(a.dtype.char == "?" for a in arrays):
            raise TypeError(f"ReduceOp.{op.name} does not apply to bool tensors; use MIN or MAX")
        native = [i for i, a in enumerate(arrays) if a.dtype.char in NCCL_DTYPES]
        if len(native) < len(arrays):  # int16, complex, ...: NCCL lacks them
            return self._split(comm, arrays, native, op, opts, deadline)
        size = comm.Get_size()
        topology = comm_topology(comm, deadline)
        algorithm = self.algorithm_for(0, size, topology, getattr(opts, "algorithm", "auto"))[0]
        originals, wires, buckets = device_buckets(arrays, op, opts, self._plans,
                                                   widen_half=False)
        outs = [cupy.empty_like(send) for send, _ in buckets]
        if algorithm == "hierarchical":
            transport = _NcclTransport(deadline)  # NCCL inside nodes, MPI across
            for (send, _), out in zip(buckets, outs):
                hierarchical.run(comm, send, out, op, deadline, transport)
        elif algorithm == "reduce_broadcast":
            ncomm = nccl_comm(comm, deadline)
            for (send, _), out in zip(buckets, outs):
                dtype = NCCL_DTYPES[send.dtype.char]
                ncomm.nccl.reduce(send.data.ptr, out.data.ptr, send.size, dtype, _NCCL_OPS[op],
                                  0, ncomm.stream())
                ncomm.nccl.bcast(out.data.ptr, send.size, dtype, 0, ncomm.stream())
            ncomm.wait(deadline, f"all_reduce {op.name}")
        else:
            ncomm = nccl_comm(comm, deadline)
            nccl.groupStart()  # every bucket in one launch
            for (send, _), out in zip(buckets, outs):
                ncomm.nccl.allReduce(send.data.ptr, out.data.ptr, send.size,
                                     NCCL_DTYPES[send.dtype.char], _NCCL_OPS[op], ncomm.stream())
            nccl.groupEnd()
            ncomm.wait(deadline, f"all_reduce {op.name}")
        results: List = [None] * len(arrays)
        for (_, members), out in zip(buckets, outs):
            if op is ReduceOp.MEAN:
                divide_on_device(out, size)
            device_unpack(out, members, originals, wires, results)
        return [from_cupy_like(r, a) for r, a in zip(results, arrays)]

    def _split(self, comm, arrays, native, op, opts, deadline):
        """Tensors of dtypes NCCL lacks go through the staged backend; the rest through NCCL."""
        results: List = [None] * len(arrays)
        other = [i for i in range(len(arrays)) if i not in set(native)]
        for indices, backend in ((native, self), (other, self._staged)):
            if indices:
                done = backend.all_reduce(comm, [arrays[i] for i in indices], op, opts, deadline)
                for i, r in zip(indices, done):
                    results[i] = r
        return results

    def all_gather(self, comm, arrays, counts, axis, deadline):
        import cupy
        if not all(on_cuda(a) for a in arrays) or comm_topology(comm, deadline).gpu_shared:
            # (ranks of different simulated nodes sharing a GPU cannot form one NCCL comm)
            return self._staged.all_gather(comm, arrays, counts, axis, deadline)
        ncomm = nccl_comm(comm, deadline)
        results = []
        for array, rows in zip(arrays, counts):
            value = as_cupy(array)
            front = cupy.ascontiguousarray(cupy.moveaxis(value, axis, 0))
            row_elems = int(np.prod(front.shape[1:], dtype=np.int64))
            gathered = cupy.empty((sum(rows),) + front.shape[1:], dtype=front.dtype)
            flat = gathered.reshape(-1)
            offsets = np.concatenate([[0], np.cumsum([r * row_elems for r in rows])]).tolist()
            bounds = list(zip(offsets[:-1], offsets[1:]))
            a, b = bounds[ncomm.rank]
            flat[a:b] = front.reshape(-1)  # this rank's block in place, then share the rest
            _gather_in_place(ncomm, flat, bounds)
            results.append(cupy.moveaxis(gathered, 0, axis))
        ncomm.wait(deadline, "all_gather")
        return [from_cupy_like(r, a) for r, a in zip(results, arrays)]

    def broadcast(self, comm, arrays, root, deadline):
        import cupy
        from cupy.cuda import nccl
        if not all(on_cuda(a) for a in arrays) or comm_topology(comm, deadline).gpu_shared:
            return self._staged.broadcast(comm, arrays, root, deadline)
        ncomm = nccl_comm(comm, deadline)
        buffers = [cupy.array(as_cupy(a), copy=True, order="C") for a in arrays]
        nccl.groupStart()
        for buffer in buffers:
            ncomm.nccl.bcast(buffer.data.ptr, buffer.nbytes, _UINT8, root, ncomm.stream())
        nccl.groupEnd()
        ncomm.wait(deadline, f"broadcast root={root}")
        return [from_cupy_like(b, a) for b, a in zip(buffers, arrays)]
