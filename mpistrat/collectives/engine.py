"""``CollectiveEngine``: the single entry point of every collective.

Each call flattens its nested input, checks that the engine is still
usable, validates across ranks (``validation.agree``), picks the backend
for each kind of array (``backends.select_backend``), records a trace line
when ``MPISTRAT_TRACE=1``, runs, and rebuilds the structure::

    >>> import numpy as np
    >>> from mpistrat.collectives import CollectiveEngine
    >>> from mpistrat.runtime import get_world
    >>> engine = CollectiveEngine(get_world().comm)
    >>> engine.all_reduce({"w": np.ones(3)}, "SUM")["w"]      # doctest: +SKIP
    array([2., 2., 2.])                                        # on 2 ranks
"""

import logging
import math
import operator
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.backends import select_backend
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.dtypes import dtype_code, refuse
from mpistrat.collectives.options import CommunicationImplementation, CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.reproducible import deterministic_default, exact_sum
from mpistrat.collectives.structure import flatten
from mpistrat.collectives.topology import comm_topology
from mpistrat.collectives.validation import (FOLDABLE, PAYLOAD_SLOTS, Probe, agree, fold_result,
                                             start_agree, validation_enabled)
from mpistrat.errors import AbortedError, DeadlineExceededError, InvalidArgumentError
from mpistrat.runtime import settings
from mpistrat.runtime import timeline
from mpistrat.runtime.devices import Capabilities, array_kind, capabilities, from_host, to_host

__all__ = ["CollectiveEngine", "default_timeout"]

log = logging.getLogger("mpistrat.collectives")


def _configure_trace() -> None:
    if not settings.get("MPISTRAT_TRACE", at_import=True) or log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    rank = MPI.COMM_WORLD.Get_rank()
    handler.setFormatter(logging.Formatter(f"[mpistrat rank {rank}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


_configure_trace()


def default_timeout() -> Optional[float]:
    """The timeout used when options give none (``MPISTRAT_COLLECTIVE_TIMEOUT`` seconds)."""
    return settings.get("MPISTRAT_COLLECTIVE_TIMEOUT")


def _as_array(value: Any):
    if type(value) is np.ndarray:
        return value
    return value if array_kind(value) != "numpy" else np.asarray(value)


_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
_NDARRAY_ONLY = {np.ndarray}


def _signature(arrays) -> tuple:
    """``(dtype, shape)`` per tensor, built in C (``map``): the key of every cache. Device
    arrays also carry their kind (ranks that mix NumPy and CuPy would pick different backends)."""
    signature = tuple(map(_DTYPE_SHAPE, arrays))
    if set(map(type, arrays)) <= _NDARRAY_ONLY:
        return signature
    kinds = [array_kind(a) for a in arrays]
    if all(kind == "numpy" for kind in kinds):
        return signature
    return tuple((dtype if kind == "numpy" else f"{dtype_code(dtype)}@{kind}", tuple(shape))
                 for kind, (dtype, shape) in zip(kinds, signature))


def _dtype_key(array) -> str:
    """A dtype as NumPy's short code (``dtypes.dtype_code``), with the kind of a device array."""
    return dtype_code(array.dtype) if type(array) is np.ndarray else \
        f"{dtype_code(array.dtype)}@{array_kind(array)}".replace("@numpy", "")


_ALL_REDUCE_WHAT = {op: f"all_reduce {op.name}" for op in ReduceOp}
_EXACT = (ReduceOp.SUM, ReduceOp.MEAN)
_ENGINES = [0]  # engines made so far: ids that match across ranks (made in the same order)


class CollectiveEngine:
    """Collectives over one communicator: ``all_reduce``, ``all_gather``, ``broadcast``.

    After a collective times out the ranks are out of step; the engine then
    refuses every further call with ``AbortedError`` instead of hanging.
    """

    def __init__(self, comm: MPI.Comm, options: Optional[CommunicationOptions] = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.options = options or CommunicationOptions()
        self.validate = validation_enabled()
        self.default_timeout = default_timeout()  # read once, when the engine is made
        self._trace = log.isEnabledFor(logging.DEBUG)
        self._broken: Optional[str] = None
        self._calls = 0
        self.deterministic = deterministic_default()  # MPISTRAT_DETERMINISTIC, read once
        self._id = _ENGINES[0] = _ENGINES[0] + 1
        self._backend_name = ""
        self._probe = Probe(comm)
        self._folds_plain = self._folds()  # (its inputs are read once, above)
        self._scalar_probes: Dict[tuple, tuple] = {}  # reduce_scalar's probes, by op and type
        self._flag_probes: Dict[int, tuple] = {}      # count_ranks' probes, by flag count
        self._small_probes: Dict[tuple, tuple] = {}   # small arrays', by op, dtype, shape
        self._exact_guesses: Dict[tuple, tuple] = {}  # reproducible sums' exponents, guessed

    # -- the common prologue -------------------------------------------------
    def _prologue(self, what: str, options: Optional[CommunicationOptions]):
        """Refuse if broken; count the call; the merged options, timeout and deadline."""
        if self._broken:
            raise AbortedError(f"{what} refused on rank {self.rank}: {self._broken}")
        opts = self.options.merge(options)
        timeout = opts.timeout_seconds if opts.timeout_seconds is not None else self.default_timeout
        self._calls += 1
        return opts, timeout, Deadline.after(timeout)

    def _begin(self, what: str, signature: tuple, options: Optional[CommunicationOptions]):
        opts, timeout, deadline = self._prologue(what, options)
        if self._trace:
            total = sum(int(np.prod(shape, dtype=np.int64)) for _, shape in signature)
            log.debug("#%d %s: %d tensors, %d elements, timeout=%s", self._calls, what,
                      len(signature), total, timeout)
        if self.validate and self.size > 1:
            self._guard(agree, self.comm, what, signature, deadline)
        return opts, deadline

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except DeadlineExceededError as err:
            self._broken = f"an earlier collective timed out ({err})"
            raise

    def _run(self, what, arrays, opts, call):
        """Group ``arrays`` by kind, run ``call(backend, indices)`` per group."""
        if all(type(a) is np.ndarray for a in arrays):  # the common case: one host group
            if timeline.ON:
                self._backend_name = _HOST_BACKEND.name
            if self._trace:
                log.debug("#%d %s: %d numpy tensors via %s", self._calls, what, len(arrays),
                          _HOST_BACKEND.name)
            return self._guard(call, _HOST_BACKEND, range(len(arrays)))
        results: List = [None] * len(arrays)
        groups: Dict[str, List[int]] = {}
        for index, array in enumerate(arrays):
            groups.setdefault(array_kind(array), []).append(index)
        for kind, indices in groups.items():
            backend = _HOST_BACKEND if kind == "numpy" else select_backend(
                kind, opts.implementation, capabilities(), comm_topology(self.comm))
            if timeline.ON:
                self._backend_name = backend.name
            if self._trace:
                log.debug("#%d %s: %d %s tensors via %s", self._calls, what, len(indices), kind,
                          backend.name)
            for index, result in zip(indices, self._guard(call, backend, indices)):
                results[index] = result
        return results

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, value: Any, op, options: Optional[CommunicationOptions] = None) -> Any:
        """Combine ``value`` (a nest of arrays) element-wise over all ranks.

        With ``CommunicationOptions(deterministic=True)`` (or
        ``MPISTRAT_DETERMINISTIC=1``) SUM and MEAN are bitwise reproducible
        (``collectives/reproducible.py``).
        """
        start = timeline.begin(value) if timeline.ON else None
        op = ReduceOp.from_any(op)
        kind = type(value)
        if options is None and (kind is float or kind in _FOLD_SCALARS):
            total = self.reduce_scalar(op, value)  # validated and summed in one call
            if total is not None:                  # (None with the timeline on: below)
                return np.asarray(total)
        flat = (kind is list or kind is tuple) and set(map(type, value)) <= _NDARRAY_ONLY
        if flat:  # a plain list or tuple of NumPy arrays: no flattening, no conversion
            arrays, rebuild = value, None
        else:      # any nest or JAX pytree (collectives/structure.py)
            leaves, rebuild = flatten(value)
            arrays = [_as_array(v) for v in leaves]
        if op in _EXACT and self.is_deterministic(options):
            results = self._exact(arrays, op, None, options, value)[0]
        else:
            what = _ALL_REDUCE_WHAT[op]
            signature = _signature(arrays)
            if len(arrays) == 1 and op in _EXACT and arrays[0].size <= PAYLOAD_SLOTS and \
                    arrays[0].dtype in FOLDABLE and self._folds(options):
                results = [self._fold_small(op, arrays[0], signature)]
            else:
                opts, deadline = self._begin(what, signature, options)
                refuse(what, arrays, op, value)
                if flat:
                    if timeline.ON:
                        self._backend_name = _HOST_BACKEND.name
                    results = self._guard(_HOST_BACKEND.all_reduce, self.comm, arrays, op,
                                          opts, deadline, signature)
                else:
                    results = self._run(what, arrays, opts, lambda backend, idx: backend.all_reduce(
                        self.comm, [arrays[i] for i in idx], op, opts, deadline))
        if start is not None:
            self._record(_ALL_REDUCE_WHAT[op], start, arrays)
        if flat:
            return results if kind is list else tuple(results)
        return rebuild(results)

    def reduce_scalar(self, op, value) -> Any:
        """``all_reduce`` of a Python float (as a NumPy ``float64``) or of a NumPy scalar of a
        ``FOLDABLE`` dtype (as a scalar of its dtype), or ``None`` where the value does not
        ride in the validation probe (then ``all_reduce`` takes it): the scalar hot path of
        ``Strategy.reduce`` (a loss, a count), one collective and no arrays. The result is
        ``all_reduce``'s: summed in float64 (exact for these values), a MEAN divided (integers
        truncated toward zero), rounded once to the dtype."""
        kind = type(value)
        if kind is np.ndarray:
            return self._reduce_small(op, value)
        try:
            ready = self._scalar_probes.get((op, kind))  # by the op as given ("SUM", ...)
        except TypeError:  # (an unhashable op: the long path names it)
            return None
        if ready is None:
            if kind is not float and kind not in _FOLD_SCALARS:
                return self._reduce_jax(op, value) if kind.__name__ == "ArrayImpl" and \
                    array_kind(value) == "jax" else None
            exact = ReduceOp.from_any(op)
            if not self._folds_plain or exact not in _EXACT or len(self._scalar_probes) > 64:
                return None
            what = _ALL_REDUCE_WHAT[exact]
            signature = _SCALAR_SIGNATURE if kind is float else _signature([value])
            dtype = np.dtype(kind) if kind is not float else _FLOAT64
            ready = self._scalar_probes[(op, kind)] = (
                exact is ReduceOp.MEAN, dtype.kind in "iu", dtype.type, what, signature,
                self._probe.ready(what, signature))
        if timeline.ON or self._broken:
            return None  # (all_reduce records the call, or refuses it)
        self._calls += 1
        mean, integer, make, what, signature, probe = ready
        if self._trace:
            self._trace_fold(what, 1)
        total = self._probe.sum_ready(probe, what, signature, float(value))
        if mean:
            total = math.trunc(total / self.size) if integer else total / self.size
        if integer:  # an exact integer: a SUM beyond the dtype wraps, as MPI's does
            return np.array(int(total), np.int64).astype(make)[()]
        return make(total)

    def _reduce_jax(self, op, value) -> Any:
        """``reduce_scalar`` for a JAX array of at most ``PAYLOAD_SLOTS`` values of a
        ``FOLDABLE`` dtype (a loss): its host copy takes the NumPy path, and the result goes
        back to its device as the long path's would."""
        if value.size > PAYLOAD_SLOTS or value.dtype not in FOLDABLE:
            return None
        host = np.asarray(value)
        total = self.reduce_scalar(op, host[()] if host.ndim == 0 else host)
        return None if total is None else from_host(np.asarray(total), value)

    def _reduce_small(self, op, array: np.ndarray) -> Optional[np.ndarray]:
        """``reduce_scalar`` for a NumPy array of 1 to ``PAYLOAD_SLOTS`` values of a
        ``FOLDABLE`` dtype (at least one dimension): a new array of its dtype and shape."""
        try:
            ready = self._small_probes.get((op, array.dtype, array.shape))
        except TypeError:
            return None
        if ready is None:
            if not (0 < array.size <= PAYLOAD_SLOTS and array.ndim and array.dtype in FOLDABLE):
                return None
            exact = ReduceOp.from_any(op)
            if not self._folds_plain or exact not in _EXACT or len(self._small_probes) > 64:
                return None
            what = _ALL_REDUCE_WHAT[exact]
            signature = _signature([array])
            probe = self._probe.ready(what, signature)
            float_mean = exact is ReduceOp.MEAN and array.dtype.kind == "f"
            # made once per op, dtype and shape: the probe's payload and sums as arrays of
            # the shape, and the float MEAN's divisor (fold_result's arithmetic: divided in
            # float64, then rounded once into the dtype)
            ready = self._small_probes[(op, array.dtype, array.shape)] = (
                exact, what, signature, probe,
                np.frombuffer(probe[0], np.float64, array.size).reshape(array.shape),
                self._probe.recv_values[:array.size].reshape(array.shape),
                float(self.size) if float_mean else None)
        if timeline.ON or self._broken:
            return None
        self._calls += 1
        exact, what, signature, probe, payload, sums, divisor = ready
        if self._trace:
            self._trace_fold(what, array.size)
        np.copyto(payload, array)
        self._probe.exchange(probe, what, signature)
        if divisor is not None:
            mean = sums / divisor
            return mean if array.dtype == _FLOAT64 else mean.astype(array.dtype)
        return fold_result(sums.copy(), exact, self.size, array.dtype)

    def count_ranks(self, flags: Sequence[bool]) -> Sequence[float]:
        """How many ranks raise each of a few flags: the float64 SUM of ``flags`` over ranks
        (what ``all_reduce`` of ``np.array(flags, np.float64)`` gives, one collective in
        the validation probe), from a probe kept ready per flag count: the per-step
        lockstep of distributed datasets."""
        count = len(flags)
        ready = self._flag_probes.get(count)
        if ready is None or timeline.ON or self._broken:
            if ready is None and self._folds_plain and 0 < count <= PAYLOAD_SLOTS:
                signature = _signature([np.zeros(count)])
                self._flag_probes[count] = (signature, self._probe.ready(
                    _ALL_REDUCE_WHAT[ReduceOp.SUM], signature))
            return self.all_reduce(np.array(flags, np.float64), ReduceOp.SUM)
        self._calls += 1
        signature, probe = ready
        if self._trace:
            self._trace_fold(_ALL_REDUCE_WHAT[ReduceOp.SUM], count)
        return self._probe.sum_values(probe, _ALL_REDUCE_WHAT[ReduceOp.SUM], signature, flags)

    # -- the validated small SUM: the probe carries the values (validation.Probe) --------
    def _folds(self, options: Optional[CommunicationOptions] = None) -> bool:
        """Whether a small float64 SUM/MEAN rides with the validation probe: validated,
        several ranks, no deadline, not deterministic (all part of what ranks agree on)."""
        if not self.validate or self.size == 1 or self.deterministic or self.options.deterministic:
            return False
        if options is not None and (options.deterministic or options.timeout_seconds is not None):
            return False
        return self.options.timeout_seconds is None and self.default_timeout is None

    def _trace_fold(self, what: str, elements: int, kind: str = "numpy") -> None:
        log.debug("#%d %s: 1 tensors, %d elements, timeout=None", self._calls, what, elements)
        log.debug("#%d %s: 1 %s tensors via %s (inside the validation probe)", self._calls, what,
                  kind, _HOST_BACKEND.name)

    def _fold_small(self, op: ReduceOp, array, signature: tuple):
        _, _, deadline = self._prologue("all_reduce", None)
        if self._trace:
            self._trace_fold(_ALL_REDUCE_WHAT[op], array.size, array_kind(array))
        host = array if type(array) is np.ndarray else to_host(array)
        sums = self._probe.sum_with(_ALL_REDUCE_WHAT[op], signature, deadline, host)
        out = fold_result(sums.reshape(host.shape).copy(), op, self.size, host.dtype)
        if timeline.ON:
            self._backend_name = "validation-probe"
        return out if type(array) is np.ndarray else from_host(out, array)

    def is_deterministic(self, options: Optional[CommunicationOptions] = None) -> bool:
        """Whether SUM and MEAN take the reproducible path for these per-call options."""
        return self.deterministic or self.options.deterministic or bool(
            options is not None and options.deterministic)

    def exact_sum(self, arrays: List, axis: Optional[int],
                  options: Optional[CommunicationOptions] = None, op="SUM"):
        """Reproducible SUM (or MEAN) over ranks of ``arrays``, element-wise or of all rows
        along ``axis``: ``(results, global summand counts)`` (see ``reproducible``); results
        keep each array's dtype and kind."""
        start = timeline.begin(arrays) if timeline.ON else None
        arrays = [_as_array(a) for a in arrays]
        out = self._exact(arrays, ReduceOp.from_any(op), axis, options, arrays)
        if start is not None:
            self._record(f"exact sum axis={axis}", start, arrays)
        return out

    def _exact(self, arrays, op, axis, options, value):
        what = f"deterministic {_ALL_REDUCE_WHAT[op]} axis={axis}"
        signature = tuple((dtype_code(a.dtype), tuple(
            -1 if axis is not None and d == axis % a.ndim else n for d, n in enumerate(a.shape)))
            for a in arrays)
        opts, deadline = self._begin(what, signature, options)
        refuse(what, arrays, op, value)
        kinds = {array_kind(a) for a in arrays}
        hosts = [to_host(a) if array_kind(a) != "numpy" else a for a in arrays]

        def sum_across(wires):
            return self._run(what, wires, opts, lambda backend, idx: backend.all_reduce(
                self.comm, [wires[i] for i in idx], ReduceOp.SUM, opts, deadline))

        sums, counts = self._guard(exact_sum, self.comm, hosts, axis, sum_across, deadline,
                                   op is ReduceOp.MEAN, self._exact_guesses)
        if kinds != {"numpy"}:
            sums = [from_host(s, a) if array_kind(a) != "numpy" else s
                    for s, a in zip(sums, arrays)]
        return sums, counts

    def _record(self, what: str, start: float, arrays) -> None:
        timeline.end(what, start, sum(getattr(a, "nbytes", 0) for a in arrays),
                     {"engine": self._id, "seq": self._calls, "backend": self._backend_name,
                      "tensors": len(arrays), "ranks": self.size})

    def all_gather(self, value: Any, axis: int = 0,
                   options: Optional[CommunicationOptions] = None) -> Any:
        """Concatenate ``value`` from all ranks along ``axis``, in rank order.

        Shapes may differ along ``axis`` only; anything else raises
        ``InvalidArgumentError`` (a ``ValueError``) on every rank, naming ranks.
        """
        start = timeline.begin(value) if timeline.ON else None
        leaves, rebuild = flatten(value)
        arrays = [_as_array(v) for v in leaves]
        what = f"all_gather axis={axis}"
        masked = tuple((_dtype_key(a),
                        tuple(-1 if d == _axis_or_none(axis, a.ndim) else n
                              for d, n in enumerate(a.shape))) for a in arrays)
        opts, deadline = self._begin(what, masked, options)
        refuse(what, arrays, None, value)
        for index, array in enumerate(arrays):
            if array.ndim == 0:
                raise InvalidArgumentError(
                    f"{what}: tensor {index} is a scalar (rank-0) on every rank; gather "
                    f"concatenates along an axis, so reshape it to [1] or use reduce")
            if _axis_or_none(axis, array.ndim) is None:
                raise InvalidArgumentError(
                    f"{what}: axis {axis} is out of range for tensor {index} of shape "
                    f"{tuple(array.shape)}")
        counts = self._gather_counts(what, arrays, axis, deadline)
        results = self._run(what, arrays, opts, lambda backend, idx: backend.all_gather(
            self.comm, [arrays[i] for i in idx], [counts[i] for i in idx],
            _axis_or_none(axis, arrays[idx[0]].ndim), deadline))
        if start is not None:
            self._record(what, start, results)
        return rebuild(results)

    def _gather_counts(self, what, arrays, axis, deadline) -> List[List[int]]:
        """Rows along ``axis`` of every tensor on every rank: ``counts[tensor][rank]``."""
        mine = np.array([a.shape[_axis_or_none(axis, a.ndim)] for a in arrays], dtype=np.int64)
        table = np.empty((self.size, len(arrays)), dtype=np.int64)
        if deadline is None:
            self.comm.Allgather(mine, table)
        else:
            self._guard(wait_all, [self.comm.Iallgather(mine, table)], deadline, what)
        return table.T.tolist()

    def broadcast(self, value: Any, root: int = 0,
                  options: Optional[CommunicationOptions] = None) -> Any:
        """Every rank receives ``root``'s ``value`` (same structure, shapes and dtypes)."""
        start = timeline.begin(value) if timeline.ON else None
        leaves, rebuild = flatten(value)
        arrays = [_as_array(v) for v in leaves]
        what = f"broadcast root={root}"
        opts, deadline = self._begin(what, _signature(arrays), options)
        refuse(what, arrays, None, value)
        results = self._run(what, arrays, opts, lambda backend, idx: backend.broadcast(
            self.comm, [arrays[i] for i in idx], root, deadline))
        if start is not None:
            self._record(what, start, arrays)
        return rebuild(results)

    def agree(self, what: str, signature: tuple,
              options: Optional[CommunicationOptions] = None) -> None:
        """Check that all ranks pass the same ``signature`` of ``(dtype, shape)`` entries.

        Lets a caller make a rank-local error (a bad axis, say) a collective
        one, so every rank raises together instead of one rank leaving.
        """
        self._begin(what, signature, options)

    def start_agree(self, what: str, signature: tuple) -> Callable[[], None]:
        """``agree`` without waiting: returns the function that waits and raises.

        The probe travels while the caller prepares its work (``TPUStrategy.run``
        assembles its inputs meanwhile). A no-op when validation is off.
        """
        _, _, deadline = self._prologue(what, None)
        if not self.validate or self.size == 1:
            return _nothing
        finish = start_agree(self.comm, what, signature, deadline)
        return lambda: self._guard(finish)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast small picklable metadata (never array data)."""
        if self._broken:
            raise AbortedError(f"broadcast_object refused on rank {self.rank}: {self._broken}")
        return self.comm.bcast(obj, root=root)

    def barrier(self, options: Optional[CommunicationOptions] = None) -> None:
        """Wait until every rank has arrived (honours the timeout)."""
        _, deadline = self._begin("barrier", (), options)
        self._guard(wait_all, [self.comm.Ibarrier()], deadline, "barrier")


def _nothing() -> None:
    return None


def _axis_or_none(axis: int, ndim: int) -> Optional[int]:
    """``axis`` normalised into ``[0, ndim)``, or ``None`` when out of range."""
    if -ndim <= axis < ndim:
        return axis % ndim
    return None


_SCALAR_SIGNATURE = _signature([np.float64(0.0)])  # a Python float's, as the long path builds it
_FLOAT64 = np.dtype(np.float64)
_FOLD_SCALARS = frozenset(d.type for d in FOLDABLE)
_HOST_CAPS = Capabilities(cuda_aware_mpi=False, nccl=False)  # NumPy needs no detection
_HOST_BACKEND = select_backend("numpy", CommunicationImplementation.AUTO, _HOST_CAPS)
