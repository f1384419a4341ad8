"""The ways to run an all-reduce: op objects with one small interface, in one ordered table.

``CollectiveEngine.all_reduce`` builds an ``AllReduceCall`` and runs the first op of
``table`` whose ``enabled(call)`` is true (Horovod's op manager has this shape; the backends
of ``collectives/backends`` are chosen the same way, for each kind of array). Every op has:

* ``name``: what the trace and the timeline show;
* ``enabled(call)``: may it run this call? A function of the op, dtypes, shapes, kinds and
  options alone, so every rank that passes the same call chooses the same op;
* ``path(call)``: the op's name and the settings that steer its MPI calls. It is part of
  the hash the ranks agree on before anything travels (``validation.agree``): ranks that
  would pair different MPI calls raise together, naming each rank's path, instead of hanging;
* ``run(call)``: the results, new arrays the caller owns (``writes_out``: or ``call.outs``,
  filled; the engine copies the other ops' results there).

The ops, in the table's order:

``Reproducible``: SUM and MEAN with ``deterministic`` (``collectives/reproducible.py``).
``ProbeFold``: one SUM or MEAN of at most ``PAYLOAD_SLOTS`` values of a ``FOLDABLE`` dtype
rides in the validation probe itself, summed in float64 (exact for these dtypes): one
collective that validates and reduces. ``PlainCall``: with validation off, one small NumPy
array takes MPI's own blocking ``Allreduce`` in its dtype, the call ``HostOp`` makes for it,
without its layers. ``HostOp``: NumPy arrays, fused by dtype, each bucket by the algorithm
the rules or the tuning table choose (``backends/host.py``: MPI's own, the ring,
Rabenseifner, hierarchical). ``ByKind``: device arrays, each kind by the first usable
backend (NCCL, CUDA-aware MPI, staged through the host).

``ProbeFold`` and ``PlainCall`` also ``prepare`` a call: a function for the next values of
the same op, type, dtype and shape, with the buffers and the hash made once (the scalar hot
path of ``Strategy.reduce``, ``CollectiveEngine.reduce_scalar``)::

    >>> from mpistrat.collectives.allreduce_ops import EXACT
    >>> [op.name for op in EXACT]
    ['SUM', 'MEAN']
"""

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from mpistrat.collectives import algorithms
from mpistrat.collectives.backends import select_backend
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.dtypes import accumulator
from mpistrat.collectives.options import CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean
from mpistrat.collectives.reproducible import exact_sum
from mpistrat.collectives.structure import signature_of
from mpistrat.collectives.topology import comm_topology
from mpistrat.collectives.validation import FOLDABLE, PAYLOAD_SLOTS, Probe, fold_result
from mpistrat.runtime.devices import array_kind, capabilities, from_host, to_host

__all__ = ["AllReduceCall", "Reproducible", "ProbeFold", "PlainCall", "HostOp", "ByKind",
           "each_group", "ALL_REDUCE_WHAT", "EXACT", "FOLD_SCALARS"]

ALL_REDUCE_WHAT = {op: f"all_reduce {op.name}" for op in ReduceOp}
EXACT = (ReduceOp.SUM, ReduceOp.MEAN)
FOLD_SCALARS = frozenset(d.type for d in FOLDABLE)   # NumPy scalar types that fold
_FLOAT64 = np.dtype(np.float64)
_NDARRAY_ONLY = {np.ndarray}


def steering(opts: CommunicationOptions) -> str:
    """The options that steer the host backend's MPI calls (the algorithm asked for, the
    bucket size), as they enter a path."""
    return f"algorithm={opts.algorithm} pack={opts.pack_bytes}"


class AllReduceCall:
    """One all-reduce as the ops see it: the op, the arrays (NumPy or device) and their
    signature, the options (the call's merged over the engine's: one value), the deadline,
    ``outs`` (the caller's buffers, or None) and ``what`` (its name in errors and in the
    hash)."""

    __slots__ = ("op", "arrays", "signature", "options", "deadline", "outs", "what",
                 "numpy_only")

    def __init__(self, op: ReduceOp, arrays: List, signature: tuple,
                 options: Optional[CommunicationOptions],
                 outs: Optional[List[np.ndarray]] = None, what: str = "",
                 numpy_only: Optional[bool] = None):
        self.op, self.arrays, self.signature = op, arrays, signature
        self.options, self.outs = options, outs
        self.what = what or ALL_REDUCE_WHAT[op]
        self.deadline: Optional[Deadline] = None
        self.numpy_only = set(map(type, arrays)) <= _NDARRAY_ONLY if numpy_only is None \
            else numpy_only   # (every array a NumPy array: known already for a plain list)


def _one_small(call: AllReduceCall) -> Any:
    """The call's one array when it has one of at most ``PAYLOAD_SLOTS`` values and no
    ``outs``; else None."""
    if call.outs is not None or len(call.arrays) != 1:
        return None
    array = call.arrays[0]
    return array if array.size <= PAYLOAD_SLOTS else None


class Reproducible:
    """SUM and MEAN with ``deterministic`` (an option, or ``MPISTRAT_DETERMINISTIC`` for the
    whole job: ``always``): bitwise the same whatever the rank count or order."""

    name = "reproducible"
    validates = False
    writes_out = False

    def __init__(self, comm, host_backend, always: bool):
        self.comm, self.host, self.always = comm, host_backend, always
        self.guesses: Dict[tuple, tuple] = {}   # exponents guessed per place (reproducible)

    def enabled(self, call: AllReduceCall) -> bool:
        return call.op in EXACT and (self.always or call.options.deterministic)

    def path(self, call: AllReduceCall) -> str:
        return f"{self.name} {steering(call.options)}"   # (its integers take the host backend)

    def run(self, call: AllReduceCall) -> List:
        return self.sum(call.arrays, call.op, None, call.options, call.deadline)[0]

    def sum(self, arrays: List, op: ReduceOp, axis: Optional[int], opts, deadline):
        """``(sums, global summand counts)`` of ``arrays`` (element-wise, or of all rows along
        ``axis``), each in its dtype and kind; device arrays are summed through the host."""
        kinds = {array_kind(a) for a in arrays}
        hosts = [to_host(a) if array_kind(a) != "numpy" else a for a in arrays]

        def sum_across(wires):
            return self.host.all_reduce(self.comm, wires, ReduceOp.SUM, opts, deadline)

        sums, counts = exact_sum(self.comm, hosts, axis, sum_across, deadline,
                                 op is ReduceOp.MEAN, self.guesses)
        if kinds != {"numpy"}:
            sums = [from_host(s, a) if array_kind(a) != "numpy" else s
                    for s, a in zip(sums, arrays)]
        return sums, counts


class ProbeFold:
    """A small SUM or MEAN inside the validation probe (``validation.Probe``): one
    ``Iallreduce`` validates the call and sums the values in float64; a MEAN divides there
    and the result is rounded once into the dtype (``validation.fold_result``). Any kind of
    array: its values travel from the host. ``on``: validation on, several ranks."""

    name = "validation-probe"
    validates = True   # its one collective is the validation
    writes_out = False

    def __init__(self, comm, on: bool, timeout: Optional[float]):
        self.comm, self.size, self.on = comm, comm.Get_size(), on
        self.timeout = timeout   # the engine's, for prepared calls (which take no options)
        self.probe = Probe(comm)

    def enabled(self, call: AllReduceCall) -> bool:
        array = _one_small(call) if self.on else None
        return array is not None and call.op in EXACT and array.dtype in FOLDABLE

    def path(self, call: AllReduceCall) -> str:
        return self.name

    def run(self, call: AllReduceCall) -> List:
        array = call.arrays[0]
        host = array if type(array) is np.ndarray else to_host(array)
        sums = self.probe.sum_with(call.what, signature_of([host]), call.deadline, host,
                                   self.name)   # (the host's signature: any kind meets)
        out = fold_result(sums.reshape(host.shape).copy(), call.op, self.size, host.dtype)
        return [out if type(array) is np.ndarray else from_host(out, array)]

    def prepare(self, call: AllReduceCall, value) -> Optional[Callable[[Any], Any]]:
        """The function that reduces the next ``value`` of this type (dtype and shape): a
        scalar of its type (a Python float as float64), a new array, or a JAX array."""
        kind = type(value)
        if kind is float or kind in FOLD_SCALARS:
            return self._scalar(call, np.dtype(kind) if kind is not float else _FLOAT64)
        if kind is np.ndarray:
            return self._array(call, value) if value.ndim else None
        if array_kind(value) != "jax":
            return None
        host = np.asarray(value)
        inner = self._scalar(call, host.dtype) if host.ndim == 0 else self._array(call, host)
        return lambda v: from_host(np.asarray(inner(np.asarray(v)[()])), v)

    def _scalar(self, call: AllReduceCall, dtype: np.dtype) -> Callable[[Any], Any]:
        what, signature, size, timeout = call.what, signature_of([np.zeros((), dtype)]), \
            self.size, self.timeout
        mean, integer, make = call.op is ReduceOp.MEAN, dtype.kind in "iu", dtype.type
        probe, sum_ready = self.probe.ready(what, signature, timeout is not None, self.name), \
            self.probe.sum_ready

        def run(value) -> Any:
            total = sum_ready(probe, what, signature, float(value), Deadline.after(timeout))
            if mean:
                total = math.trunc(total / size) if integer else total / size
            if integer:  # an exact integer: a SUM beyond the dtype wraps, as MPI's does
                return np.array(int(total), np.int64).astype(make)[()]
            return make(total)
        return run

    def _array(self, call: AllReduceCall, array: np.ndarray) -> Callable[[Any], Any]:
        what, signature, op, size, timeout = call.what, signature_of([array]), call.op, \
            self.size, self.timeout
        probe = self.probe.ready(what, signature, timeout is not None, self.name)
        # the probe's payload and sums as arrays of the shape, and the float MEAN's divisor
        # (fold_result's arithmetic: divided in float64, then rounded once into the dtype)
        payload = np.frombuffer(probe[0], np.float64, array.size).reshape(array.shape)
        sums = self.probe.recv_values[:array.size].reshape(array.shape)
        divisor = float(size) if op is ReduceOp.MEAN and array.dtype.kind == "f" else None
        dtype, exchange = array.dtype, self.probe.exchange

        def run(value: np.ndarray) -> np.ndarray:
            np.copyto(payload, value)
            exchange(probe, what, signature, Deadline.after(timeout))
            if divisor is not None:
                mean = sums / divisor
                return mean if dtype == _FLOAT64 else mean.astype(dtype)
            return fold_result(sums.copy(), op, size, dtype)
        return run


class PlainCall:
    """Validation off: one small NumPy array by MPI's own blocking out-of-place
    ``Allreduce`` in its dtype, then ``divide_for_mean``: the call and the bits ``HostOp``
    gives it, without its layers. ``on``: validation off, several ranks, no job-wide
    reproducible sums or timeout, and no ring threshold within the small arrays' bytes (read once)."""

    name = "mpi-allreduce"
    validates = False
    writes_out = False

    def __init__(self, comm, on: bool):
        self.comm, self.size = comm, comm.Get_size()
        self.on = on and not 0 <= algorithms.RING_THRESHOLD_BYTES <= 8 * PAYLOAD_SLOTS

    def enabled(self, call: AllReduceCall) -> bool:
        array = _one_small(call) if self.on else None
        opts = call.options
        return type(array) is np.ndarray and opts.timeout_seconds is None and \
            opts.algorithm == "auto" and accumulator(array.dtype, call.op) == array.dtype

    def path(self, call: AllReduceCall) -> str:
        return self.name

    def run(self, call: AllReduceCall) -> List:
        return [self._reduce(call.arrays[0], call.op.mpi_op, call.op is ReduceOp.MEAN)]

    def _reduce(self, array: np.ndarray, mpi_op, mean: bool) -> np.ndarray:
        send = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        out = np.empty_like(send)
        self.comm.Allreduce(send, out, mpi_op)
        if mean:
            divide_for_mean(out, self.size)
        return out

    def prepare(self, call: AllReduceCall, value) -> Optional[Callable[[Any], Any]]:
        """As ``ProbeFold.prepare``, for NumPy values (a device array keeps its backend)."""
        kind, mpi_op, mean = type(value), call.op.mpi_op, call.op is ReduceOp.MEAN
        if kind is np.ndarray:
            return (lambda array: self._reduce(array, mpi_op, mean)) if value.ndim else None
        if kind is not float and kind not in FOLD_SCALARS:
            return None
        dtype = call.arrays[0].dtype
        send, total, comm, size = np.empty(1, dtype), np.empty(1, dtype), self.comm, self.size
        mean_as = dtype.type if mean else None

        def run(value) -> Any:
            send[0] = value
            comm.Allreduce(send, total, mpi_op)   # (out of place, as HostOp's)
            if mean_as is not None:   # (a float: divided in float64 and rounded once, the
                return mean_as(float(total[0]) / size)   # bits of float32's division too)
            return total[0]
        return run


class HostOp:
    """NumPy arrays through the host backend (``backends/host.py``): fused by dtype, each
    buffer by the algorithm its size, the topology and the tuning table choose. Its path
    names the options that steer those choices (the algorithm asked for, the bucket size)."""

    name = "host-mpi"
    validates = False
    writes_out = True   # (into the caller's buffers: collectives/out_buffers.py)

    def __init__(self, comm, backend, engine_options: CommunicationOptions):
        self.comm, self.backend = comm, backend
        self._default = (engine_options, self._describe(engine_options))

    def enabled(self, call: AllReduceCall) -> bool:
        return call.numpy_only

    def path(self, call: AllReduceCall) -> str:
        opts, text = self._default
        return text if call.options is opts else self._describe(call.options)

    @staticmethod
    def _describe(opts: CommunicationOptions) -> str:
        return f"host-mpi {steering(opts)}"

    def run(self, call: AllReduceCall) -> List:
        return self.backend.all_reduce(self.comm, call.arrays, call.op, call.options,
                                       call.deadline, call.signature, call.outs)


class ByKind:
    """Arrays of several kinds, or device arrays: each kind by the first usable backend
    (``backends.select_backend``: NCCL, CUDA-aware MPI, staged through the host; NumPy
    arrays by the host backend). Its path names the implementation asked for and this
    rank's capabilities (and the host backend's options), so ranks whose GPUs differ in what
    they can do raise together."""

    name = "by-kind"
    validates = False
    writes_out = False

    def __init__(self, comm, host_backend):
        self.comm, self.host = comm, host_backend

    def enabled(self, call: AllReduceCall) -> bool:
        return call.outs is None

    def path(self, call: AllReduceCall) -> str:
        return f"by-kind implementation={call.options.implementation.name} {steering(call.options)} " \
            f"{capabilities()}"   # (staged and NumPy arrays take the host backend)

    def backends(self, arrays: List, opts) -> List[Tuple[Any, List[int]]]:
        """``(backend, indices)`` for each kind among ``arrays``, in order of appearance."""
        groups: Dict[str, List[int]] = {}
        for index, array in enumerate(arrays):
            groups.setdefault(array_kind(array), []).append(index)
        return [(self.host if kind == "numpy" else select_backend(
            kind, opts.implementation, capabilities(), comm_topology(self.comm)), indices)
            for kind, indices in groups.items()]

    def run(self, call: AllReduceCall) -> List:
        return each_group(self.backends(call.arrays, call.options), len(call.arrays),
                          lambda backend, indices: backend.all_reduce(
                              self.comm, [call.arrays[i] for i in indices], call.op,
                              call.options, call.deadline))


def each_group(groups, count: int, run: Callable[[Any, Any], List]) -> List:
    """``run(backend, indices)`` for each ``(backend, indices)`` group of ``count`` arrays,
    the results put back in the arrays' order (one group of them all: its results as
    they are)."""
    if len(groups) == 1 and len(groups[0][1]) == count:
        return run(*groups[0])
    results: List = [None] * count
    for backend, indices in groups:
        for index, result in zip(indices, run(backend, indices)):
            results[index] = result
    return results
