"""``CollectiveEngine``: the single entry point of every collective.

Each call flattens its nested input, checks that the engine is still usable, merges the
options and sets the deadline, traces (``collectives/trace.py``) and records the timeline,
once; an all-reduce runs the first op of one ordered table that takes it
(``collectives/allreduce_ops.py``), the op's path agreed with the signature across ranks
(``validation.agree``); a gather or broadcast takes the backend of each kind of array
(``backends.select_backend``). The results are rebuilt into the input's structure::

    >>> import numpy as np
    >>> from mpistrat.collectives import CollectiveEngine
    >>> from mpistrat.runtime import get_world
    >>> engine = CollectiveEngine(get_world().comm)
    >>> engine.all_reduce({"w": np.ones(3)}, "SUM")["w"]      # doctest: +SKIP
    array([2., 2., 2.])                                        # on 2 ranks
"""

from typing import Any, Callable, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.allreduce_ops import (ALL_REDUCE_WHAT, FOLD_SCALARS, AllReduceCall,
                                                ByKind, HostOp, PlainCall, ProbeFold,
                                                Reproducible, each_group)
from mpistrat.collectives.backends import select_backend
from mpistrat.collectives.buffer_pool import default_cap
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.dtypes import dtype_code, refuse
from mpistrat.collectives.host_callbacks import TRACED, settle
from mpistrat.collectives.out_buffers import out_lists, out_problem, place_of
from mpistrat.collectives.options import CommunicationImplementation, CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.reproducible import deterministic_default
from mpistrat.collectives.structure import (axis_or_none, flatten, gather_signature, leaf_names,
                                            signature_of)
from mpistrat.collectives import agreement, objects, trace  # noqa: I100 - (the tracing's logger, set up at import)
from mpistrat.collectives.validation import (PAYLOAD_SLOTS, agree, start_agree,
                                             validation_enabled)
from mpistrat.errors import AbortedError, DeadlineExceededError, InvalidArgumentError
from mpistrat.runtime import settings
from mpistrat.runtime import timeline
from mpistrat.runtime.allocator import keep_freed_memory
from mpistrat.runtime.devices import Capabilities, array_kind

__all__ = ["CollectiveEngine", "default_timeout"]


def default_timeout() -> Optional[float]:
    """The timeout used when options give none (``MPISTRAT_COLLECTIVE_TIMEOUT`` seconds)."""
    return settings.get("MPISTRAT_COLLECTIVE_TIMEOUT")


def _as_array(value: Any):
    if type(value) is np.ndarray:
        return value
    return value if array_kind(value) != "numpy" else np.asarray(value)


_NDARRAY_ONLY = {np.ndarray}
_ENGINES = [0]  # engines made so far: ids that match across ranks (made in the same order)
_UNKNOWN = object()   # a prepared call not looked for yet
_MAX_PREPARED = 256   # prepared calls an engine keeps (by op, type, dtype and shape)


class CollectiveEngine:
    """Collectives over one communicator: ``all_reduce``, ``all_gather``, ``broadcast``.

    ``all_reduce`` runs the first op of one ordered table that takes the call
    (``collectives/allreduce_ops.py``); the op's path is part of what the ranks agree on.
    After a collective times out the ranks are out of step; the engine then
    refuses every further call with ``AbortedError`` instead of hanging.
    """

    def __init__(self, comm: MPI.Comm, options: Optional[CommunicationOptions] = None):
        keep_freed_memory(default_cap())   # results are new arrays: reuse freed pages (once)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # the environment's defaults (MPISTRAT_COLLECTIVE_TIMEOUT, MPISTRAT_DETERMINISTIC) folded
        # in once, under the given options: every call merges its own over this one value
        self.options = CommunicationOptions(timeout_seconds=default_timeout(),
                                            deterministic=deterministic_default()).merge(options)
        self.validate = validation_enabled()
        self._trace = trace.on()   # MPISTRAT_TRACE (collectives/trace.py)
        self._broken: Optional[str] = None
        self._calls = 0
        self._id = _ENGINES[0] = _ENGINES[0] + 1
        timeout, deterministic = self.options.timeout_seconds, self.options.deterministic
        several = self.size > 1
        self._reproducible = Reproducible(comm, _HOST_BACKEND, deterministic)
        self._by_kind = ByKind(comm, _HOST_BACKEND)
        # the all-reduce's ops, in the order they are asked (allreduce_ops.py)
        self.ops = (self._reproducible,
                    ProbeFold(comm, self.validate and several, timeout),
                    PlainCall(comm, not self.validate and several and not deterministic
                              and timeout is None),
                    HostOp(comm, _HOST_BACKEND, self.options),
                    self._by_kind)
        self._prepared: Dict[tuple, Any] = {}   # reduce_scalar's prepared calls

    # -- the common prologue -------------------------------------------------
    def _prologue(self, what: str, options: Optional[CommunicationOptions]):
        """Refuse if broken; count the call; the merged options, timeout and deadline."""
        if self._broken:
            raise AbortedError(f"{what} refused on rank {self.rank}: {self._broken}")
        opts = self.options.merge(options)
        timeout = opts.timeout_seconds
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first, in program order
            settle()   # (host_callbacks.py)
        return opts, timeout, Deadline.after(timeout)

    def _begin(self, what: str, signature: tuple, options: Optional[CommunicationOptions],
               path: str = ""):
        opts, timeout, deadline = self._prologue(what, options)
        self._trace_call(what, signature, timeout)
        if self.validate and self.size > 1:
            self._guard(agree, self.comm, what, signature, deadline, path)
        return opts, deadline

    def _trace_call(self, what: str, signature: tuple, timeout) -> None:
        if self._trace:
            trace.call(self._calls, what, signature, timeout)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except DeadlineExceededError as err:
            self._broken = f"an earlier collective timed out ({err})"
            raise

    def _run(self, what, arrays, opts, call):
        """Group ``arrays`` by kind, run ``call(backend, indices)`` per group."""
        def traced(backend, indices):
            if self._trace:
                trace.route(self._calls, what, len(indices), array_kind(arrays[indices[0]]),
                            backend.name)
            return self._guard(call, backend, indices)
        return each_group(self._backends(arrays, opts), len(arrays), traced)

    def _backends(self, arrays, opts):
        if all(type(a) is np.ndarray for a in arrays):  # the common case: one host group
            return [(_HOST_BACKEND, range(len(arrays)))]
        return self._by_kind.backends(arrays, opts)

    # -- the all-reduce: one table of ops ------------------------------------
    def all_reduce(self, value: Any, op, options: Optional[CommunicationOptions] = None,
                   out: Any = None, *, label: Optional[str] = None) -> Any:
        """Combine ``value`` (a nest of arrays) element-wise over all ranks.

        With ``CommunicationOptions(deterministic=True)`` (or
        ``MPISTRAT_DETERMINISTIC=1``) SUM and MEAN are bitwise reproducible
        (``collectives/reproducible.py``). ``out`` (NumPy arrays: one, or a list or
        tuple matching ``value``) receives the results, which are returned; ``out=value``
        reduces in place (``collectives/out_buffers.py``); a bad ``out`` on any rank raises on
        every rank (its text, or where ``out`` lies, is part of what the ranks agree on)::

            grads = engine.all_reduce(grads, "SUM", out=grads)   # the caller's buffers

        ``label`` (a caller's text: Horovod's tensor name, say) joins the call's name, which
        the ranks agree on in the same probe: ranks whose labels differ raise together,
        naming each rank's.
        """
        kind = type(value)
        if label is None and options is None and out is None and \
                (kind is float or kind in FOLD_SCALARS):
            total = self.reduce_scalar(op, value)  # a prepared call (None: the table's)
            if total is not None:
                return np.asarray(total)
        start = timeline.begin(value) if timeline.ON else None
        op = ReduceOp.from_any(op)
        flat = (kind is list or kind is tuple) and set(map(type, value)) <= _NDARRAY_ONLY
        outs = None
        name = _labelled(ALL_REDUCE_WHAT[op], label)
        if out is not None:
            problem = out_problem(value, out)
            what = f"{name} into out ({problem or place_of(value, out)})"
            if problem is not None:   # raised on every rank (agree names each rank's text)
                if self.validate and self.size > 1:
                    self._begin(what, (), options, "refused")
                raise InvalidArgumentError(what)
            arrays, outs = out_lists(value, out)
        elif flat:  # a plain list or tuple of NumPy arrays: no flattening, no conversion
            arrays, what = value, name
        else:      # any nest or JAX pytree (collectives/structure.py)
            leaves, rebuild = flatten(value)
            arrays, what = [_as_array(v) for v in leaves], name
        call = AllReduceCall(op, arrays, signature_of(arrays), None, outs, what,
                             True if flat else None)
        results, chosen = self._dispatch(call, value, options)
        if start is not None:
            self._record(ALL_REDUCE_WHAT[op], start, arrays, self._label(chosen, call))
        if out is not None:
            return out
        if flat:
            return results if kind is list else tuple(results)
        return rebuild(results)

    def _dispatch(self, call: AllReduceCall, value: Any,
                  options: Optional[CommunicationOptions]):
        """The prologue once (refusal when broken, ``options`` merged over the engine's into
        ``call.options``, deadline, trace), the first enabled op, the agreement on the call and
        that op's path, the op's run: ``(results, op)``; results land in ``call.outs``."""
        call.options, timeout, call.deadline = self._prologue(call.what, options)
        chosen = self._choose(call)
        self._trace_call(call.what, call.signature, timeout)
        if self._trace:
            trace.route(self._calls, call.what, len(call.arrays), _kinds(call.arrays),
                        chosen.name)
        if self.validate and self.size > 1 and not chosen.validates:
            self._guard(agree, self.comm, call.what, call.signature, call.deadline,
                        chosen.path(call))
        refuse(call.what, call.arrays, call.op, lambda: leaf_names(value))
        results = self._guard(chosen.run, call)
        if call.outs is not None and not chosen.writes_out:
            for target, result in zip(call.outs, results):
                np.copyto(target, result)
        return results, chosen

    def path_of(self, value: Any, op, options: Optional[CommunicationOptions] = None) -> str:
        """The path ``all_reduce(value, op, options)`` takes on this rank (its op and the
        settings that steer it): what the ranks agree on besides the signature::

            >>> engine.path_of(1.0, "SUM")                             # doctest: +SKIP
            'validation-probe'
        """
        leaves, _ = flatten(value)
        arrays = [_as_array(v) for v in leaves]
        call = AllReduceCall(ReduceOp.from_any(op), arrays, signature_of(arrays),
                             self.options.merge(options))
        return self._choose(call).path(call)

    def _choose(self, call: AllReduceCall):
        for candidate in self.ops:
            if candidate.enabled(call):
                return candidate
        raise InvalidArgumentError(f"{call.what}: no way to run it for "
                                   f"{_kinds(call.arrays)} arrays with these options")

    def reduce_scalar(self, op, value) -> Any:
        """``all_reduce`` of one value by a call prepared for its op, type, dtype and shape
        (``allreduce_ops``: buffers and hash made once; a small SUM or MEAN rides in the
        validation probe, one collective), or ``None`` where the table's op for it prepares
        nothing (then ``all_reduce`` takes it): the scalar hot path of ``Strategy.reduce`` for
        a Python float (a ``float64`` result), a NumPy scalar (one of its type), a NumPy
        array of at least one dimension or a JAX array of at most 10 values. Also ``None``
        with the timeline or the trace on, whose records ``all_reduce`` makes::

            >>> engine.reduce_scalar("SUM", np.float32(1.5))          # doctest: +SKIP
            np.float32(3.0)                                            # on 2 ranks
        """
        kind = type(value)
        if kind is not float and kind not in FOLD_SCALARS and \
                getattr(value, "size", PAYLOAD_SLOTS + 1) > PAYLOAD_SLOTS:
            return None   # (no op prepares more values: nothing kept for it)
        try:
            key = (op, kind) if kind is float or kind in FOLD_SCALARS else \
                (op, kind, value.dtype, value.shape)
            prepared = self._prepared.get(key, _UNKNOWN)
        except TypeError:   # (an unhashable op: the long path names it)
            return None
        if prepared is _UNKNOWN:
            prepared = self._prepare(op, value)
            if len(self._prepared) < _MAX_PREPARED:
                self._prepared[key] = prepared
        if prepared is None or timeline.ON or self._broken or self._trace:
            return None
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first (host_callbacks.py)
            settle()
        try:   # (_guard's work, inline: one call less on the hot path)
            return prepared(value)
        except DeadlineExceededError as err:
            self._broken = f"an earlier collective timed out ({err})"
            raise

    def _prepare(self, op, value) -> Optional[Callable[[Any], Any]]:
        """The chosen op's prepared call for values like ``value`` (options None), if any."""
        try:
            exact = ReduceOp.from_any(op)
        except ValueError:
            return None
        if type(value) is not float and not hasattr(value, "dtype"):
            return None
        array = _as_array(value)
        call = AllReduceCall(exact, [array], signature_of([array]), self.options)
        chosen = self._choose(call)
        prepare = getattr(chosen, "prepare", None)
        return prepare(call, value) if prepare is not None else None

    def count_ranks(self, flags) -> Any:
        """How many ranks raise each of a few flags: the float64 SUM of ``flags`` over ranks
        (one collective, inside the validation probe where it is on): the per-step lockstep
        of distributed datasets."""
        values = np.array(flags, np.float64)
        counts = self.reduce_scalar(ReduceOp.SUM, values)
        return counts if counts is not None else self.all_reduce(values, ReduceOp.SUM)

    def is_deterministic(self, options: Optional[CommunicationOptions] = None) -> bool:
        """Whether SUM and MEAN take the reproducible path for these per-call options."""
        return self.options.merge(options).deterministic

    def exact_sum(self, arrays: List, axis: Optional[int],
                  options: Optional[CommunicationOptions] = None, op="SUM"):
        """Reproducible SUM (or MEAN) over ranks of ``arrays``, element-wise or of all rows
        along ``axis``: ``(results, global summand counts)`` (see ``reproducible``); results
        keep each array's dtype and kind."""
        start = timeline.begin(arrays) if timeline.ON else None
        arrays = [_as_array(a) for a in arrays]
        op = ReduceOp.from_any(op)
        what = f"deterministic {ALL_REDUCE_WHAT[op]} axis={axis}"
        signature = tuple((dtype_code(a.dtype), tuple(
            -1 if axis is not None and d == axis % a.ndim else n for d, n in enumerate(a.shape)))
            for a in arrays)
        opts, deadline = self._begin(what, signature, options, Reproducible.name)
        refuse(what, arrays, op, lambda: leaf_names(arrays))
        out = self._guard(self._reproducible.sum, arrays, op, axis, opts, deadline)
        if start is not None:
            self._record(f"exact sum axis={axis}", start, arrays, Reproducible.name)
        return out

    def _label(self, chosen, call: AllReduceCall) -> str:
        """The timeline's name for how a call ran: the op, or the backends of each kind."""
        return chosen.name if chosen is not self._by_kind else \
            self._label_of(call.arrays, call.options)

    def _label_of(self, arrays, opts) -> str:
        return "+".join(backend.name for backend, _ in self._backends(arrays, opts))

    def _record(self, what: str, start: float, arrays, backend: str) -> None:
        timeline.end(what, start, sum(getattr(a, "nbytes", 0) for a in arrays),
                     {"engine": self._id, "seq": self._calls, "backend": backend,
                      "tensors": len(arrays), "ranks": self.size})

    def all_gather(self, value: Any, axis: int = 0,
                   options: Optional[CommunicationOptions] = None, *,
                   label: Optional[str] = None) -> Any:
        """Concatenate ``value`` from all ranks along ``axis``, in rank order.

        Shapes may differ along ``axis`` only; anything else raises
        ``InvalidArgumentError`` (a ``ValueError``) on every rank, naming ranks.
        ``label``: as ``all_reduce``'s, agreed with the call.
        """
        start = timeline.begin(value) if timeline.ON else None
        leaves, rebuild = flatten(value)
        arrays = [_as_array(v) for v in leaves]
        what = _labelled(f"all_gather axis={axis}", label)
        opts, deadline = self._begin(what, gather_signature(arrays, axis), options)
        refuse(what, arrays, None, lambda: leaf_names(value))
        for index, array in enumerate(arrays):
            if array.ndim == 0:
                raise InvalidArgumentError(
                    f"{what}: tensor {index} is a scalar (rank-0) on every rank; gather "
                    f"concatenates along an axis, so reshape it to [1] or use reduce")
            if axis_or_none(axis, array.ndim) is None:
                raise InvalidArgumentError(
                    f"{what}: axis {axis} is out of range for tensor {index} of shape "
                    f"{tuple(array.shape)}")
        counts = self._gather_counts(what, arrays, axis, deadline)
        results = self._run(what, arrays, opts, lambda backend, idx: backend.all_gather(
            self.comm, [arrays[i] for i in idx], [counts[i] for i in idx],
            axis_or_none(axis, arrays[idx[0]].ndim), deadline))
        if start is not None:
            self._record(what, start, results, self._label_of(arrays, opts))
        return rebuild(results)

    def _gather_counts(self, what, arrays, axis, deadline) -> List[List[int]]:
        """Rows along ``axis`` of every tensor on every rank: ``counts[tensor][rank]``."""
        mine = np.array([a.shape[axis_or_none(axis, a.ndim)] for a in arrays], dtype=np.int64)
        table = np.empty((self.size, len(arrays)), dtype=np.int64)
        if deadline is None:
            self.comm.Allgather(mine, table)
        else:
            self._guard(wait_all, [self.comm.Iallgather(mine, table)], deadline, what)
        return table.T.tolist()

    def broadcast(self, value: Any, root: int = 0,
                  options: Optional[CommunicationOptions] = None, *,
                  label: Optional[str] = None) -> Any:
        """Every rank receives ``root``'s ``value`` (same structure, shapes and dtypes).

        The root is part of what the ranks agree on: ranks that name different roots raise
        together, naming each rank's; a root that is no rank raises ``InvalidArgumentError``.
        ``label``: as ``all_reduce``'s, agreed with the call."""
        start = timeline.begin(value) if timeline.ON else None
        leaves, rebuild = flatten(value)
        arrays = [_as_array(v) for v in leaves]
        what = _labelled(f"broadcast root={root}", label)
        opts, deadline = self._begin(what, signature_of(arrays), options)
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise InvalidArgumentError(f"{what}: the root {root!r} is not a rank (ranks are 0 "
                                       f"to {self.size - 1})")
        refuse(what, arrays, None, lambda: leaf_names(value))
        results = self._run(what, arrays, opts, lambda backend, idx: backend.broadcast(
            self.comm, [arrays[i] for i in idx], root, deadline))
        if start is not None:
            self._record(what, start, arrays, self._label_of(arrays, opts))
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

    # -- small picklable metadata, and waits, under the same deadline ---------------------
    def broadcast_object(self, obj: Any, root: int = 0, what: str = "broadcast_object") -> Any:
        """``root``'s small picklable ``obj`` on every rank (never array data; timed)."""
        return objects.broadcast_object(self, obj, root, what)

    def allgather_object(self, obj: Any, what: str = "allgather_object") -> List[Any]:
        """Every rank's small picklable ``obj``, in rank order (timed)."""
        return objects.allgather_object(self, obj, what)

    def gather_object(self, obj: Any, root: int = 0, what: str = "gather_object"):
        """Every rank's ``obj`` in rank order on ``root``, ``None`` elsewhere (timed)."""
        return objects.gather_object(self, obj, root, what)

    def agreed(self, what: str, doing: str = "", hint: str = ""):
        """A block whose failure on any rank raises the same error on every rank
        (``agreement.agreed``)::

            with engine.agreed("preparing a TFRecordDataset", doing="indexing a file"):
                build_index()
        """
        return agreement.agreed(self, what, doing, hint)

    def wait(self, requests: List[MPI.Request], what: str) -> None:
        """Wait for this engine's nonblocking ``requests`` under its deadline.

        ``DeadlineExceededError`` naming ``what`` when the timeout passes; the engine
        then refuses further calls (the ranks are out of step)::

            engine.wait([engine.comm.Ibcast(offsets, root=0)], "the record offsets")
        """
        self._guard(wait_all, requests, objects.deadline_of(self), what)

    def barrier(self, options: Optional[CommunicationOptions] = None) -> None:
        """Wait until every rank has arrived (honours the timeout)."""
        _, deadline = self._begin("barrier", (), options)
        self._guard(wait_all, [self.comm.Ibarrier()], deadline, "barrier")


def _labelled(what: str, label: Optional[str]) -> str:
    """The name the ranks agree on: ``what``, and the caller's ``label`` in parentheses."""
    return what if label is None else f"{what} ({label})"


def _kinds(arrays) -> str:
    return "/".join(sorted({array_kind(a) for a in arrays})) or "no"


def _nothing() -> None:
    return None


_HOST_CAPS = Capabilities(cuda_aware_mpi=False, nccl=False)  # NumPy needs no detection
_HOST_BACKEND = select_backend("numpy", CommunicationImplementation.AUTO, _HOST_CAPS)
