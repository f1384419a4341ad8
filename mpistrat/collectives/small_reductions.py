"""The small reductions: a loss, a count, a few flags, in one collective and no arrays.

``CollectiveEngine`` takes these methods from ``SmallReductions``. A SUM or MEAN of a Python
float, a NumPy scalar, a NumPy or JAX array of at most ``PAYLOAD_SLOTS`` values of a
``FOLDABLE`` dtype rides in the validation probe (``validation.Probe``): one ``Iallreduce``
that validates the call and sums the values, from a probe kept ready per op, dtype and
shape. The probe is the long path's own protocol, so a rank on this path meets a rank on
the long one. Values are summed in float64, exactly for these dtypes; a MEAN divides there,
and the result is rounded once into the dtype (``validation.fold_result``)::

    >>> import numpy as np
    >>> from mpistrat.collectives import CollectiveEngine
    >>> from mpistrat.runtime import get_world
    >>> engine = CollectiveEngine(get_world().comm)
    >>> engine.reduce_scalar("SUM", np.float32(1.5))              # doctest: +SKIP
    np.float32(3.0)                                                # on 2 ranks

With validation off (``MPISTRAT_VALIDATE=0``) a NumPy scalar or small array and the flags take
the long path's own MPI call where its rules give MPI's own for them (``_unvalidated_plain``):
a blocking out-of-place ``Allreduce`` in their dtype, without the long path's layers
(``_reduce_unvalidated``, ``_small_unvalidated``). JAX values keep the long path there.

The mixin reads the engine's state: ``comm``, ``size``, ``_probe``, the three probe caches,
``_plain_scalars``, ``_plain_arrays``, ``_folds_plain``, ``_fold_timeout``, ``_plain_ok``, ``_calls``, ``_broken``, ``_trace``, and
its ``_prologue``, ``_guard`` and ``all_reduce``.
"""

import logging
import math
from typing import Any, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import algorithms
from mpistrat.collectives.backends.host import HostMPI
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.dtypes import accumulator
from mpistrat.collectives.host_callbacks import TRACED, settle
from mpistrat.collectives.options import CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean
from mpistrat.collectives.structure import signature_of
from mpistrat.collectives.validation import FOLDABLE, PAYLOAD_SLOTS, fold_result
from mpistrat.runtime import timeline
from mpistrat.runtime.devices import array_kind, from_host, to_host

__all__ = ["SmallReductions", "ALL_REDUCE_WHAT", "EXACT", "FOLD_SCALARS"]

log = logging.getLogger("mpistrat.collectives")

ALL_REDUCE_WHAT = {op: f"all_reduce {op.name}" for op in ReduceOp}
EXACT = (ReduceOp.SUM, ReduceOp.MEAN)
FOLD_SCALARS = frozenset(d.type for d in FOLDABLE)   # NumPy scalar types that fold
_SCALAR_SIGNATURE = signature_of([np.float64(0.0)])  # a Python float's, as the long path's
_FLOAT64 = np.dtype(np.float64)


class SmallReductions:
    """The small-reduction paths of ``CollectiveEngine`` (see the module docstring)."""

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
            if kind is not float and kind not in FOLD_SCALARS:
                return self._reduce_jax(op, value) if kind.__name__ == "ArrayImpl" and \
                    array_kind(value) == "jax" else None
            if not self._folds_plain:
                return self._reduce_unvalidated(op, kind, value)
            exact = ReduceOp.from_any(op)
            if exact not in EXACT or len(self._scalar_probes) > 64:
                return None
            what = ALL_REDUCE_WHAT[exact]
            signature = _SCALAR_SIGNATURE if kind is float else signature_of([value])
            dtype = np.dtype(kind) if kind is not float else _FLOAT64
            ready = self._scalar_probes[(op, kind)] = (
                exact is ReduceOp.MEAN, dtype.kind in "iu", dtype.type, what, signature,
                self._probe.ready(what, signature, self._fold_timeout is not None))
        if timeline.ON or self._broken:
            return None  # (all_reduce records the call, or refuses it)
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first (host_callbacks.py)
            settle()
        mean, integer, make, what, signature, probe = ready
        if self._trace:
            self._trace_fold(what, 1)
        total = self._guard(self._probe.sum_ready, probe, what, signature, float(value),
                            Deadline.after(self._fold_timeout))   # (a timeout breaks it)
        if mean:
            total = math.trunc(total / self.size) if integer else total / self.size
        if integer:  # an exact integer: a SUM beyond the dtype wraps, as MPI's does
            return np.array(int(total), np.int64).astype(make)[()]
        return make(total)

    def _reduce_unvalidated(self, op, kind: type, value) -> Any:
        """``reduce_scalar`` with validation off (``MPISTRAT_VALIDATE=0``): the long path's
        own MPI call, one blocking ``Allreduce`` of the value in its wire dtype (float64 for
        a Python float), so a rank here meets a rank on the long path, with none of its
        layers; a MEAN's quotient has the bits of ``divide_for_mean``'s. None (the long path)
        where the wire is not the dtype itself, or with a deadline, a reproducible sum, the
        timeline, the trace or one rank."""
        ready = self._plain_scalars.get((op, kind))
        if ready is None:
            if not self._plain_ok or len(self._plain_scalars) > 64:   # (kind: a float or
                return None                            # in FOLD_SCALARS, reduce_scalar's test)
            exact = ReduceOp.from_any(op)
            dtype = _FLOAT64 if kind is float else np.dtype(kind)
            if accumulator(dtype, exact) != dtype:
                return None
            ready = self._plain_scalars[(op, kind)] = (
                np.empty(1, dtype), np.empty(1, dtype), exact.mpi_op,
                dtype.type if exact is ReduceOp.MEAN else None)
        if timeline.ON or self._broken or self._trace:
            return None
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first (host_callbacks.py)
            settle()
        send, total, mpi_op, mean_as = ready
        send[0] = value
        self.comm.Allreduce(send, total, mpi_op)   # (out of place, as the long path's)
        if mean_as is not None:   # (a float: divided in float64 and rounded once, the bits
            return mean_as(float(total[0]) / self.size)    # of float32's own division too)
        return total[0]

    def _small_unvalidated(self, op, array: np.ndarray) -> Optional[np.ndarray]:
        """``_reduce_small`` (or ``count_ranks``) with validation off: as
        ``_reduce_unvalidated``, the long path's own call for one tensor (a blocking
        out-of-place ``Allreduce`` in the dtype, then ``divide_for_mean``) into a new array;
        None where the wire is another dtype or the long path is due."""
        if not self._plain_ok or timeline.ON or self._broken or self._trace:
            return None
        ready = self._plain_arrays.get((op, array.dtype))
        if ready is None:
            exact = ReduceOp.from_any(op)
            if accumulator(array.dtype, exact) != array.dtype or len(self._plain_arrays) > 64:
                return None
            ready = self._plain_arrays[(op, array.dtype)] = (exact.mpi_op,
                                                             exact is ReduceOp.MEAN)
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first (host_callbacks.py)
            settle()
        mpi_op, mean = ready
        send = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        out = np.empty_like(send)
        self.comm.Allreduce(send, out, mpi_op)
        if mean:
            divide_for_mean(out, self.size)
        return out

    def _reduce_jax(self, op, value) -> Any:
        """``reduce_scalar`` for a JAX array of at most ``PAYLOAD_SLOTS`` values of a
        ``FOLDABLE`` dtype (a loss): its host copy takes the NumPy path, and the result goes
        back to its device as the long path's would."""
        if value.size > PAYLOAD_SLOTS or value.dtype not in FOLDABLE or not self._folds_plain:
            return None   # (validation off: the long path, whose backend may be NCCL's)
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
            if not self._folds_plain:
                return self._small_unvalidated(op, array)
            exact = ReduceOp.from_any(op)
            if exact not in EXACT or len(self._small_probes) > 64:
                return None
            what = ALL_REDUCE_WHAT[exact]
            signature = signature_of([array])
            probe = self._probe.ready(what, signature, self._fold_timeout is not None)
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
        if TRACED[0]:   # host callbacks' collectives first (host_callbacks.py)
            settle()
        exact, what, signature, probe, payload, sums, divisor = ready
        if self._trace:
            self._trace_fold(what, array.size)
        np.copyto(payload, array)
        self._guard(self._probe.exchange, probe, what, signature,
                    Deadline.after(self._fold_timeout))
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
            if not self._folds_plain and 0 < count <= PAYLOAD_SLOTS:
                counts = self._small_unvalidated(ReduceOp.SUM, np.array(flags, np.float64))
                if counts is not None:
                    return counts
            if ready is None and self._folds_plain and 0 < count <= PAYLOAD_SLOTS:
                signature = signature_of([np.zeros(count)])
                self._flag_probes[count] = (signature, self._probe.ready(
                    ALL_REDUCE_WHAT[ReduceOp.SUM], signature, self._fold_timeout is not None))
            return self.all_reduce(np.array(flags, np.float64), ReduceOp.SUM)
        self._calls += 1
        if TRACED[0]:   # host callbacks' collectives first (host_callbacks.py)
            settle()
        signature, probe = ready
        if self._trace:
            self._trace_fold(ALL_REDUCE_WHAT[ReduceOp.SUM], count)
        return self._guard(self._probe.sum_values, probe, ALL_REDUCE_WHAT[ReduceOp.SUM],
                           signature, flags, Deadline.after(self._fold_timeout))

    # -- the validated small SUM: the probe carries the values (validation.Probe) --------
    def _folds(self, options: Optional[CommunicationOptions] = None) -> bool:
        """Whether a small float64 SUM/MEAN rides with the validation probe: validated,
        several ranks, not deterministic (all part of what ranks agree on). With a deadline
        the probe is timed, and its hash says so, as the long path's does: a timed rank
        never meets an untimed one unnoticed."""
        if not self.validate or not self._ordinary():
            return False
        return options is None or not options.deterministic

    def _ordinary(self) -> bool:
        """Several ranks, no reproducible sums: what both one-collective small paths
        (``_folds``, ``_unvalidated_plain``) need of the engine."""
        return self.size > 1 and not (self.deterministic or self.options.deterministic)

    def _unvalidated_plain(self) -> bool:
        """Whether ``_reduce_unvalidated`` and ``_small_unvalidated`` may take a scalar, a
        small array or the flags: validation off, several ranks, no deadline, not
        deterministic, and MPI's own call where the long path's rules stand for buffers of
        ``PAYLOAD_SLOTS`` values or fewer: no algorithm asked for (the long path runs it even
        for one value) and no ring threshold at or below their bytes (read once, as
        ``_folds`` is)."""
        ring_from = algorithms.RING_THRESHOLD_BYTES
        return not self.validate and self._ordinary() and self._fold_timeout is None and \
            getattr(self.options, "algorithm", "auto") == "auto" and \
            not 0 <= ring_from <= 8 * PAYLOAD_SLOTS

    def _trace_fold(self, what: str, elements: int, kind: str = "numpy", timeout=None) -> None:
        log.debug("#%d %s: 1 tensors, %d elements, timeout=%s", self._calls, what, elements,
                  self._fold_timeout if timeout is None else timeout)
        log.debug("#%d %s: 1 %s tensors via %s (inside the validation probe)", self._calls, what,
                  kind, HostMPI.name)

    def _fold_small(self, op: ReduceOp, array, signature: tuple,
                    options: Optional[CommunicationOptions] = None):
        _, timeout, deadline = self._prologue("all_reduce", options)
        if self._trace:
            self._trace_fold(ALL_REDUCE_WHAT[op], array.size, array_kind(array), timeout)
        host = array if type(array) is np.ndarray else to_host(array)
        sums = self._guard(self._probe.sum_with, ALL_REDUCE_WHAT[op], signature, deadline, host)
        out = fold_result(sums.reshape(host.shape).copy(), op, self.size, host.dtype)
        if timeline.ON:
            self._backend_name = "validation-probe"
        return out if type(array) is np.ndarray else from_host(out, array)
