"""``ms.Variable``: mutable state that strategies keep in sync.

Created inside ``strategy.scope()`` a variable is distributed: every rank
starts from rank 0's initial value. ``ON_WRITE`` (the default) variables are
mirrored and updated through their aggregation; ``ON_READ`` ones keep a
value per replica and are combined when read in cross-replica context.
A variable lives where its replica computes: made from a CuPy value, or in
the scope of a strategy whose replica is a GPU (with CuPy installed), it
holds a CuPy array on that GPU; made from a JAX array it holds JAX arrays
(on that array's device); ``numpy()`` and checkpoints copy it to the host,
and a restore puts the value back on the device::

    >>> import mpistrat as ms
    >>> v = ms.Variable(1.0)                  # outside any scope: an ordinary variable
    >>> v.assign_add(2.0).numpy()
    array(3.)

A distributed variable used outside every scope behaves as TensorFlow's: the
code runs as if in its strategy's scope, in cross-replica context. A write
there applies the same value on every replica (``assign_add(1)`` on a
``SUM``-aggregated mirrored variable adds 1, at any width), and a read of an
``ON_READ`` variable returns the combined value (a collective: every rank
must read it). Only inside ``strategy.run`` do writes go through the
aggregation and ``ON_READ`` reads see the replica's own value.
"""

import enum
from typing import Any, Optional

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from mpistrat.collectives import ReduceOp
from mpistrat.distribute.context import current_strategy_entry
from mpistrat.runtime.devices import array_kind, cupy_available

__all__ = ["Variable", "VariableAggregation", "VariableSynchronization"]


class VariableSynchronization(enum.Enum):
    """When a distributed variable is synchronised: on write or on read."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How updates (or reads of ``ON_READ`` variables) from replicas combine."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


_REDUCE = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}


class Variable(NDArrayOperatorsMixin):
    """A named, mutable array; NumPy operators read its current value.

    ``initial_value`` may be a value or a callable returning one. Inside the
    scope of a strategy whose ``extended.variable_class`` is set (``TPUStrategy``)
    that class is made instead.
    """

    def __new__(cls, *args, **kwargs):
        entry = current_strategy_entry()
        if cls is Variable and entry is not None:
            cls = getattr(entry.strategy.extended, "variable_class", None) or cls
        return super().__new__(cls)

    def __init__(self, initial_value: Any, name: Optional[str] = None,
                 synchronization=VariableSynchronization.AUTO,
                 aggregation=VariableAggregation.NONE, trainable: Optional[bool] = None,
                 dtype=None, shape=None):
        self.synchronization = VariableSynchronization(synchronization)
        self.aggregation = VariableAggregation(aggregation)
        if self.synchronization is VariableSynchronization.AUTO:
            self.synchronization = VariableSynchronization.ON_WRITE
        self.name = name or "Variable"
        self.trainable = (self.synchronization is not VariableSynchronization.ON_READ
                          if trainable is None else bool(trainable))
        value = initial_value() if callable(initial_value) else initial_value
        entry = current_strategy_entry()
        self._strategy = entry.strategy if entry else None
        self._xp = _placement(self._strategy, value)
        value = self._xp.array(value, dtype=dtype, copy=True)
        if shape is not None and tuple(shape) != value.shape:
            raise ValueError(f"variable {self.name!r}: initial value has shape {value.shape}, "
                             f"not the requested {tuple(shape)}")
        if self._strategy is not None:
            value = self._engine.broadcast(value, root=0)
        self._value = value

    # -- facts -----------------------------------------------------------------
    @property
    def _engine(self):
        return self._strategy.extended.engine

    @property
    def distributed(self) -> bool:
        """True when created inside a strategy's scope."""
        return self._strategy is not None

    @property
    def shape(self):
        return self._value.shape

    @property
    def dtype(self):
        return self._value.dtype

    def _in_replica_context(self) -> bool:
        """Whether a read or write of this variable happens in replica context.

        Outside every scope a distributed variable is used as if in its own
        strategy's scope: cross-replica context, as TensorFlow enters the
        variable's strategy there. Inside a scope (or ``run``), the current
        context decides.
        """
        entry = current_strategy_entry()
        return entry is not None and entry.replica_context is not None

    # -- reading -----------------------------------------------------------------
    def read_value(self) -> np.ndarray:
        """The value: this replica's, or for ``ON_READ`` in cross-replica context (which
        includes outside every scope) the combined one."""
        if (self._strategy is not None and not self._in_replica_context()
                and self.synchronization is VariableSynchronization.ON_READ):
            return self._combined()
        return self._value

    value = read_value

    def numpy(self) -> np.ndarray:
        """A host (NumPy) copy of ``read_value()``."""
        return _host_copy(self.read_value())

    def _combined(self) -> np.ndarray:
        if self.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._engine.broadcast(self._value, root=0)
        if self.aggregation is VariableAggregation.NONE:
            raise ValueError(f"ON_READ variable {self.name!r} has aggregation NONE, so it has no "
                             f"cross-replica value; read it inside strategy.run, or give it SUM, "
                             f"MEAN or ONLY_FIRST_REPLICA")
        return self._engine.all_reduce(self._value, _REDUCE[self.aggregation])

    def __array__(self, dtype=None, copy=None):
        value = self.read_value()
        if array_kind(value) == "cupy":  # NumPy asks for host memory: copy it down
            value = value.get()
        value = np.asarray(value)  # TPU variables read JAX arrays
        return value.astype(dtype) if dtype is not None else (value.copy() if copy else value)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            return NotImplemented
        inputs = tuple(x.read_value() if isinstance(x, Variable) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, index):
        return self.read_value()[index]

    def __float__(self):
        return float(self.read_value())

    def __int__(self):
        return int(self.read_value())

    def __len__(self):
        return len(self._value)

    # -- writing -----------------------------------------------------------------
    def assign(self, value: Any) -> "Variable":
        """Set the value (through the aggregation in replica context)."""
        return self._update(value, lambda old, new: new, "assign")

    def assign_add(self, delta: Any) -> "Variable":
        """Add to the value (through the aggregation in replica context)."""
        return self._update(delta, lambda old, new: old + new, "assign_add")

    def assign_sub(self, delta: Any) -> "Variable":
        """Subtract from the value (through the aggregation in replica context)."""
        return self._update(delta, lambda old, new: old - new, "assign_sub")

    def _update(self, value, apply, what: str) -> "Variable":
        value = self._fit(value, what)
        if self._strategy is not None:
            value = self._synchronised_update(value, what)
        self._value = self._xp.array(apply(self._value, value), dtype=self.dtype)
        return self

    def _fit(self, value: Any, what: str) -> np.ndarray:
        """``value`` on the host, broadcast to this variable's shape and dtype, or
        ``ValueError`` naming the variable."""
        xp = self._xp
        value = value.read_value() if isinstance(value, Variable) else value
        value = xp.asarray(_host(value) if xp is np else value)  # CuPy takes host values too
        try:
            value = xp.broadcast_to(value, self.shape)
            return value.astype(self.dtype) if array_kind(value) == "jax" else \
                value.astype(self.dtype, copy=False)
        except ValueError:
            raise ValueError(f"{what} on variable {self.name!r}: value of shape {value.shape} "
                             f"does not fit shape {self.shape}") from None

    def _refuse_integer_mean(self, what: str) -> None:
        if self.aggregation is VariableAggregation.MEAN and self.dtype.kind in "iub":
            raise ValueError(f"{what} on variable {self.name!r}: aggregation MEAN cannot apply "
                             f"to an integer variable ({self.dtype}); use SUM or ONLY_FIRST_REPLICA")

    def _synchronised_update(self, value: np.ndarray, what: str,
                             in_replica: Optional[bool] = None) -> np.ndarray:
        """The update to apply on this replica, after the collective the rules require.

        ``in_replica``: whether this is a replica-context write (default: asked of
        the current context).
        """
        if in_replica is None:
            in_replica = self._in_replica_context()
        on_read = self.synchronization is VariableSynchronization.ON_READ
        if on_read and in_replica:
            return value  # per-replica value: only this replica changes
        if on_read:       # cross-replica write of an ON_READ variable
            if self.aggregation is not VariableAggregation.SUM:
                return value
            if what != "assign":
                raise ValueError(f"{what} on ON_READ variable {self.name!r} with aggregation SUM "
                                 f"is not supported in cross-replica context; use assign")
            return self._share_of_sum(value)  # so that the SUM reads back
        if not in_replica or self.aggregation is VariableAggregation.NONE:
            return value  # cross-replica writes apply the same value on every rank
        if self.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._engine.broadcast(value, root=0)
        self._refuse_integer_mean(what)
        return self._engine.all_reduce(value, _REDUCE[self.aggregation])

    def _share_of_sum(self, total) -> np.ndarray:
        """This replica's share of ``total`` for an ON_READ SUM variable: the shares sum back
        to ``total`` exactly. Integers split exactly (the first ``total mod n`` replicas hold
        one more) with one replica a rank, floats as ``total / n``."""
        total = np.asarray(_host(total))
        engine, replicas = self._engine, self._strategy.num_replicas_in_sync
        if np.dtype(self.dtype).kind not in "iu" or replicas != engine.size:
            return total / replicas  # (several replicas a rank share one value: TPUVariable)
        quotient, remainder = np.divmod(total.astype(self.dtype), engine.size)
        return quotient + (engine.rank < remainder)

    # -- checkpoints -------------------------------------------------------------
    def _checkpoint_read(self) -> np.ndarray:
        """The value a checkpoint saves: ON_READ variables save their combined value.

        Collective for distributed ON_READ variables (checkpoints read every
        variable on every rank in the same order).
        """
        if (self._strategy is not None and self.synchronization is VariableSynchronization.ON_READ
                and self.aggregation is not VariableAggregation.NONE):
            return _host(self._combined())
        return _host(self._value)

    def _checkpoint_restore(self, value: np.ndarray) -> None:
        """Put a saved value back (no communication: every rank restores the same value),
        onto the device the variable lives on."""
        value = np.asarray(value)
        if (self._strategy is not None and self.synchronization is VariableSynchronization.ON_READ
                and self.aggregation is VariableAggregation.SUM):
            value = self._share_of_sum(value)  # so that the SUM reads back
        self._value = self._xp.asarray(np.asarray(value, dtype=self.dtype))  # fresh arrays

    # -- display -----------------------------------------------------------------
    def _describe(self, value) -> str:
        value = np.asarray(_host(value))
        text = repr(value.item()) if value.ndim == 0 else np.array2string(value, separator=", ")
        return f"<ms.Variable '{self.name}:0' shape={self.shape} dtype={self.dtype.name}, numpy={text}>"


    def __repr__(self) -> str:
        if self._strategy is None:
            return self._describe(self._value)
        kind = ("SyncOnReadVariable" if self.synchronization is VariableSynchronization.ON_READ
                else "MirroredVariable")
        rid = self._strategy.extended.local_replica_ids[0]
        return f"{kind}:{{\n  {rid}: {self._describe(self._value)}\n}}"


def _placement(strategy, value):
    """The array module a variable keeps its value in: CuPy on GPU replicas, else NumPy."""
    if array_kind(value) == "cupy":
        import cupy
        return cupy
    extended = getattr(strategy, "extended", None)
    if getattr(extended, "replicas_in_compiled_steps", False):
        return np  # TPUStrategy keeps its own per-device JAX arrays
    if array_kind(value) == "jax":  # a JAX array stays one (on its device)
        import jax.numpy as jnp
        return jnp
    devices = getattr(extended, "worker_devices", ()) or ()
    if devices and "GPU:" in devices[0] and array_kind(value) == "numpy" and cupy_available():
        import cupy
        return cupy
    return np


def _host(value):
    """``value`` in host memory (CuPy arrays copied down; others unchanged)."""
    return value.get() if array_kind(value) == "cupy" else value


def _host_copy(value) -> np.ndarray:
    return value.get() if array_kind(value) == "cupy" else np.array(value, copy=True)
