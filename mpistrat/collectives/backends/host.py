"""``HostMPI``: NumPy buffers over MPI; small tensors fused by dtype, large ones unpacked.

Each fused bucket or large tensor is combined by the algorithm the tuning
table measured for its size (``calibration.table_for``, where tuning is on),
else the one ``choose_algorithm`` picks for its size and the communicator's
topology (``mpi``, ``ring``, ``hierarchical`` or ``reduce_broadcast``). Device
buffers are refused by name: this backend's MPI may not be CUDA-aware::

    >>> import numpy as np
    >>> from mpi4py import MPI
    >>> from mpistrat.collectives.backends.host import HostMPI
    >>> from mpistrat.collectives.options import CommunicationOptions
    >>> from mpistrat.collectives.reduce_op import ReduceOp
    >>> HostMPI().all_reduce(MPI.COMM_SELF, [np.ones(2)], ReduceOp.SUM, CommunicationOptions(),
    ...                      None)
    [array([1., 1.])]
"""


import numpy as np

from mpistrat.collectives import algorithms
from mpistrat.collectives.algorithms import RING_THRESHOLD_BYTES, allreduce, choose_algorithm
from mpistrat.collectives.backends import hierarchical
from mpistrat.collectives.backends.base import (Backend, factor, movable, options_of,
                                                refuse_device_buffers, wire_dtype)
from mpistrat.collectives.calibration import table_for
from mpistrat.collectives.tuning import BUCKETS
from mpistrat.collectives.dtypes import from_wire, to_wire
from mpistrat.collectives.deadline import wait_all
from mpistrat.collectives.packing import fused_all_reduce
from mpistrat.collectives.refinement import run_refined
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean
from mpistrat.collectives.topology import comm_topology

__all__ = ["HostMPI", "host_allreduce", "broadcast_buffer"]

# buffers from half the smallest tuning bucket follow the measured table where there is one
_TUNED_FROM = BUCKETS[0] // 2


def _wire(array: np.ndarray, op: ReduceOp) -> np.ndarray:
    """The contiguous buffer that travels for ``array`` (the array itself where possible)."""
    dtype = wire_dtype(array.dtype, op)
    if dtype is not array.dtype and dtype != array.dtype:
        return to_wire(array, dtype)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def host_allreduce(comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp, deadline,
                   preference: str = "auto") -> str:
    """Combine one contiguous host buffer with the algorithm chosen for it; return its name.

    A buffer of more elements than one MPI message carries (``algorithms.MESSAGE_ELEMENTS``,
    MPI's ``int`` count) is combined in pieces that fit, one after another."""
    limit = algorithms.MESSAGE_ELEMENTS
    if send.size > limit:
        flat_send, flat_recv = send.reshape(-1), recv.reshape(-1)
        name = "mpi"
        for start in range(0, send.size, limit):
            piece = flat_recv[start:start + limit]
            name = host_allreduce(comm, piece if send is recv else flat_send[start:start + limit],
                                  piece, op, deadline, preference)
        return name
    size = comm.Get_size()

    def run(algorithm: str) -> None:
        if algorithm == "hierarchical":
            hierarchical.host_allreduce(comm, send, recv, op, deadline)
        else:
            allreduce(comm, send, recv, op, deadline, algorithm)

    if size > 1 and preference == "auto" and send.nbytes >= _TUNED_FROM:
        table = table_for(comm, deadline)  # measured choices (collectives/calibration.py)
        if table is not None:   # the table's choice, refined by real calls (refinement.py)
            ran = run_refined(comm, table, send.nbytes, send.itemsize, deadline, run,
                              in_place=send is recv)
            if ran is not None:
                return ran
    # the topology matters only where the size rules leave a choice (it is measured once)
    needs_topology = size > 1 and preference == "auto" and \
        0 <= RING_THRESHOLD_BYTES <= send.nbytes
    topology = comm_topology(comm, deadline) if needs_topology else None
    algorithm = choose_algorithm(send.nbytes, size, topology=topology, preference=preference,
                                 in_place=send is recv)
    run(algorithm)
    return algorithm


def _combiner(comm, op: ReduceOp, deadline, preference: str):
    """``combine(send, recv)`` for one ``fused_all_reduce`` call: ``host_allreduce``, whose
    choice for a buffer of one byte size, element count and place (in place or not) is
    remembered for the rest of the call where no tuning table made it and the buffer is one
    MPI message. The static rules are a function of the byte size, the place, the
    communicator's topology and the preference alone, so every later buffer of that key gets
    the same algorithm with no second look at the table, topology or rules (the ResNet-50
    set has 52 tensors from 64 KiB and 17 sizes among them); the count is in the key because
    ``host_allreduce`` splits by it (``algorithms.MESSAGE_ELEMENTS``)."""
    chosen: dict = {}

    def combine(send: np.ndarray, recv: np.ndarray) -> None:
        key = (send.nbytes, send.size, send is recv)
        algorithm = chosen.get(key)
        if algorithm == "hierarchical":
            hierarchical.host_allreduce(comm, send, recv, op, deadline)
        elif algorithm is not None:
            allreduce(comm, send, recv, op, deadline, algorithm)
        else:
            algorithm = host_allreduce(comm, send, recv, op, deadline, preference)
            if send.size <= algorithms.MESSAGE_ELEMENTS and (
                    preference != "auto" or send.nbytes < _TUNED_FROM or
                    table_for(comm, deadline) is None):   # (cached by host_allreduce's call)
                chosen[key] = algorithm
    return combine


class HostMPI(Backend):
    """NumPy buffers over MPI: small tensors fused by dtype, large ones reduced unpacked."""

    name = "host-mpi"

    def __init__(self):
        self._fused: dict = {}  # packing.FusedPlan per signature

    def usable(self, kind, implementation, caps, topology=None):
        if kind == "numpy":  # host arrays travel over MPI whatever the preference for devices
            return True, "host (NumPy) arrays travel over MPI"
        return False, f"{kind} arrays are device memory; this MPI path takes host memory only"

    def all_reduce(self, comm, arrays, op, options, deadline, signature=None, out=None):
        """``signature``: the NumPy arrays' ``(dtype, shape)`` pairs, where the engine has
        built them (for validation) already; ``out``: buffers for the results, checked by
        ``collectives/out_buffers.py`` (``fused_all_reduce``)."""
        refuse_device_buffers(arrays, self.name)
        opts = options_of(options)
        preference = getattr(opts, "algorithm", "auto")
        size = comm.Get_size()
        if len(arrays) == 1 and out is None:
            return [self._reduce_one(comm, arrays[0], op, deadline, size, preference)]
        # many tensors: fused by dtype into buckets, planned once per signature
        return fused_all_reduce(comm, arrays, op, opts.pack_bytes, deadline, self._fused,
                                _combiner(comm, op, deadline, preference), signature, out)

    def _reduce_one(self, comm, array, op, deadline, size, preference):
        """One tensor: no plan, no packing (the common case of scalars and large tensors)."""
        original = array if type(array) is np.ndarray else np.asarray(array)
        if size == 1:   # one rank: every op gives the value itself, so its bytes travel
            send = np.ascontiguousarray(original).reshape(original.shape)  # (0-d stays 0-d)
            out = np.empty(send.shape, send.dtype)     # bytes as they are: no widening
            host_allreduce(comm, send.reshape(-1).view(np.uint8),
                           out.reshape(-1).view(np.uint8), ReduceOp.SUM, deadline, preference)
            return out
        wire = _wire(original, op)
        out = np.empty(wire.shape, wire.dtype)   # the caller's (runtime/allocator.py)
        host_allreduce(comm, wire, out, op, deadline, preference)
        if op is ReduceOp.MEAN:
            divide_for_mean(out, size)
        if wire.dtype is not original.dtype:
            return from_wire(out, original.dtype)
        return out

    def all_gather(self, comm, arrays, counts, axis, deadline):
        refuse_device_buffers(arrays, self.name)
        results = []
        for array, rows in zip(arrays, counts):
            array = np.asarray(array)
            # 1. bring the gather axis to the front, so each rank's block is contiguous
            front = np.ascontiguousarray(np.moveaxis(array, axis, 0))
            row_elems = int(np.prod(front.shape[1:], dtype=np.int64)) * factor(front)
            gathered = np.empty((sum(rows),) + front.shape[1:], dtype=front.dtype)
            # 2. variable-count gather in rank order (MPI's counts and displacements are C ints:
            #    a larger result goes block by block, each broadcast by its owner in pieces)
            sizes = [r * row_elems for r in rows]
            if sum(sizes) > algorithms.MESSAGE_ELEMENTS:
                flat, mine = movable(gathered).reshape(-1), movable(front).reshape(-1)
                offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
                rank = comm.Get_rank()
                flat[offsets[rank]:offsets[rank + 1]] = mine
                for owner in range(comm.Get_size()):
                    broadcast_buffer(comm, flat[offsets[owner]:offsets[owner + 1]], owner,
                                     deadline)
            elif deadline is None:
                comm.Allgatherv(movable(front), [movable(gathered), sizes])
            else:
                wait_all([comm.Iallgatherv(movable(front), [movable(gathered), sizes])],
                         deadline, "all_gather")
            # 3. put the axis back where it was
            results.append(np.moveaxis(gathered, 0, axis))
        return results

    def broadcast(self, comm, arrays, root, deadline):
        refuse_device_buffers(arrays, self.name)
        results = []
        for array in arrays:
            buffer = np.array(array, copy=True, order="C")
            broadcast_buffer(comm, movable(buffer).reshape(-1), root, deadline)
            results.append(buffer)
        return results


def broadcast_buffer(comm, flat: np.ndarray, root: int, deadline) -> None:
    """``Bcast`` of a flat host buffer, in messages MPI's ``int`` counts can carry."""
    limit = algorithms.MESSAGE_ELEMENTS
    for start in range(0, max(flat.size, 1), limit):
        piece = flat[start:start + limit]
        if deadline is None:
            comm.Bcast(piece, root=root)
        else:
            wait_all([comm.Ibcast(piece, root=root)], deadline, "broadcast")
