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
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.backends import select_backend
from mpistrat.collectives.buffer_pool import default_cap
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.dtypes import dtype_code, refuse
from mpistrat.collectives.host_callbacks import TRACED, settle
from mpistrat.collectives.into import out_lists, out_problem, place_of
from mpistrat.collectives.options import CommunicationImplementation, CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.reproducible import deterministic_default, exact_sum
from mpistrat.collectives.small_reductions import (ALL_REDUCE_WHAT, EXACT, FOLD_SCALARS,
                                                   SmallReductions)
from mpistrat.collectives.structure import flatten, signature_of
from mpistrat.collectives.topology import comm_topology
from mpistrat.collectives.validation import (FOLDABLE, PAYLOAD_SLOTS, Probe, agree, start_agree,
                                             validation_enabled)
from mpistrat.errors import AbortedError, DeadlineExceededError, InvalidArgumentError
from mpistrat.runtime import settings
from mpistrat.runtime import timeline
from mpistrat.runtime.allocator import keep_freed_memory
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


def _dtype_key(array) -> str:
    """A dtype as NumPy's short code (``dtypes.dtype_code``), with the kind of a device array."""
    return dtype_code(array.dtype) if type(array) is np.ndarray else \
        f"{dtype_code(array.dtype)}@{array_kind(array)}".replace("@numpy", "")


_NDARRAY_ONLY = {np.ndarray}
_ENGINES = [0]  # engines made so far: ids that match across ranks (made in the same order)


class CollectiveEngine(SmallReductions):
    """Collectives over one communicator: ``all_reduce``, ``all_gather``, ``broadcast``.

    After a collective times out the ranks are out of step; the engine then
    refuses every further call with ``AbortedError`` instead of hanging.
    """

    def __init__(self, comm: MPI.Comm, options: Optional[CommunicationOptions] = None):
        keep_freed_memory(default_cap())   # results are new arrays: reuse freed pages (once)
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
        # the small reductions' timeout (options give none for them): the long path's
        self._fold_timeout = self.options.timeout_seconds \
            if self.options.timeout_seconds is not None else self.default_timeout
        self._folds_plain = self._folds()  # (its inputs are read once, above)
        self._scalar_probes: Dict[tuple, tuple] = {}  # reduce_scalar's probes, by op and type
        self._flag_probes: Dict[int, tuple] = {}      # count_ranks' probes, by flag count
        self._small_probes: Dict[tuple, tuple] = {}   # small arrays', by op, dtype, shape
        self._plain_ok = self._unvalidated_plain()     # validation off: scalars' own call
        self._plain_scalars: Dict[tuple, tuple] = {}  # their buffers, by op and type
        self._plain_arrays: Dict[tuple, tuple] = {}   # small arrays' ops, by op and dtype
        self._exact_guesses: Dict[tuple, tuple] = {}  # reproducible sums' exponents, guessed

    # -- the common prologue -------------------------------------------------
    def _prologue(self, what: str, options: Optional[CommunicationOptions]):
        """Refuse if broken; count the call; the merged options, timeout and deadline."""
        if self._broken:
            raise AbortedError(f"{what} refused on rank {self.rank}: {self._broken}")
        opts = self.options.merge(options)
        timeout = opts.timeout_seconds if opts.timeout_seconds is not None else self.default_timeout
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first, in program order
            settle()   # (host_callbacks.py)
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
    def all_reduce(self, value: Any, op, options: Optional[CommunicationOptions] = None,
                   out: Any = None) -> Any:
        """Combine ``value`` (a nest of arrays) element-wise over all ranks.

        With ``CommunicationOptions(deterministic=True)`` (or
        ``MPISTRAT_DETERMINISTIC=1``) SUM and MEAN are bitwise reproducible
        (``collectives/reproducible.py``). ``out`` (NumPy arrays: one, or a list or
        tuple matching ``value``) receives the results, which are returned; ``out=value``
        reduces in place (``collectives/into.py``)::

            grads = engine.all_reduce(grads, "SUM", out=grads)   # the caller's buffers
        """
        if out is not None:
            return self._all_reduce_into(value, ReduceOp.from_any(op), options, out)
        start = timeline.begin(value) if timeline.ON else None
        op = ReduceOp.from_any(op)
        kind = type(value)
        if options is None and (kind is float or kind in FOLD_SCALARS):
            total = self.reduce_scalar(op, value)  # validated and summed in one call
            if total is not None:                  # (None with the timeline on: below)
                return np.asarray(total)
        flat = (kind is list or kind is tuple) and set(map(type, value)) <= _NDARRAY_ONLY
        if flat:  # a plain list or tuple of NumPy arrays: no flattening, no conversion
            arrays, rebuild = value, None
        else:      # any nest or JAX pytree (collectives/structure.py)
            leaves, rebuild = flatten(value)
            arrays = [_as_array(v) for v in leaves]
        if op in EXACT and self.is_deterministic(options):
            results = self._exact(arrays, op, None, options, value)[0]
        else:
            what = ALL_REDUCE_WHAT[op]
            signature = signature_of(arrays)
            if len(arrays) == 1 and op in EXACT and arrays[0].size <= PAYLOAD_SLOTS and \
                    arrays[0].dtype in FOLDABLE and self._folds(options):
                results = [self._fold_small(op, arrays[0], signature, options)]
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
            self._record(ALL_REDUCE_WHAT[op], start, arrays)
        if flat:
            return results if kind is list else tuple(results)
        return rebuild(results)

    def _all_reduce_into(self, value: Any, op: ReduceOp, options, out: Any) -> Any:
        """``all_reduce`` into ``out``: a bad ``out`` on any rank raises on every rank (its
        text, or where ``out`` lies, is part of what the ranks agree on), before anything
        travels; with validation off (``MPISTRAT_VALIDATE=0``) only on the rank that has it."""
        start = timeline.begin(value) if timeline.ON else None
        problem = out_problem(value, out)
        what = f"{ALL_REDUCE_WHAT[op]} into out ({problem or place_of(value, out)})"
        if problem is not None and not (self.validate and self.size > 1):
            raise InvalidArgumentError(what)
        arrays, outs = out_lists(value, out) if problem is None else ([], [])
        if op in EXACT and self.is_deterministic(options) and problem is None:
            results = self._exact(arrays, op, None, options, value)[0]
            for target, result in zip(outs, results):
                np.copyto(target, result)
        else:
            signature = signature_of(arrays)
            opts, deadline = self._begin(what, signature, options)
            if problem is not None:   # every rank saw the same problem (or agree raised)
                raise InvalidArgumentError(what)
            refuse(what, arrays, op, value)
            if timeline.ON:
                self._backend_name = _HOST_BACKEND.name
            self._guard(_HOST_BACKEND.all_reduce, self.comm, arrays, op, opts, deadline,
                        signature, outs)
        if start is not None:
            self._record(ALL_REDUCE_WHAT[op], start, arrays)
        return out

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
        what = f"deterministic {ALL_REDUCE_WHAT[op]} axis={axis}"
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
        opts, deadline = self._begin(what, signature_of(arrays), options)
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


_HOST_CAPS = Capabilities(cuda_aware_mpi=False, nccl=False)  # NumPy needs no detection
_HOST_BACKEND = select_backend("numpy", CommunicationImplementation.AUTO, _HOST_CAPS)
