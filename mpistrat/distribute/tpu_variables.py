"""Variables of ``TPUStrategy``: one JAX array per replica, updated inside compiled steps.

``ms.Variable(...)`` inside a ``TPUStrategy`` scope makes a ``TPUVariable``.
Its value lives on every device as one global array of shape
``(replicas, *shape)`` sharded over the replica mesh (TensorFlow keeps one
copy per device too). ``strategy.run`` passes every variable of the
strategy into the compiled step; inside it, reads and writes go through a
*trace frame* that holds the traced values, and the values written come
back out of the step and replace the stored arrays::

    with strategy.scope():
        w = ms.Variable(np.zeros(3, np.float32), aggregation=ms.VariableAggregation.MEAN)

    def step(x):
        w.assign_sub(0.1 * x)      # a pmean over all replicas, inside XLA
        return w.read_value()

    strategy.run(step, args=(batch,))

Inside a step use operators (``x @ w``, ``w * 2``) or ``w.read_value()``;
``jnp`` functions need ``w.read_value()`` (JAX no longer converts foreign
objects through ``__jax_array__``).
"""

import threading
from typing import Any, Callable, List, Optional

import numpy as np

from mpistrat.collectives import ReduceOp, xla
from mpistrat.distribute.variables import Variable, VariableAggregation, VariableSynchronization
from mpistrat.runtime import jax_bridge
from mpistrat.runtime.devices import array_kind

__all__ = ["TPUVariable", "TraceFrame", "active_frame", "frame_active", "variable_values",
           "store_written"]

_REDUCE = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
_local = threading.local()


class TraceFrame:
    """The traced value of each variable during one trace of a step."""

    def __init__(self, variables: List["TPUVariable"], values: List[Any]):
        self.variables = variables
        self._index = {id(v): i for i, v in enumerate(variables)}
        self.values = list(values)
        self.written: List[int] = []

    def _slot(self, variable: "TPUVariable") -> int:
        index = self._index.get(id(variable))
        if index is None:
            raise RuntimeError(
                f"variable {variable.name!r} is not a variable of the strategy running this "
                f"step; create it inside this TPUStrategy's scope")
        return index

    def read(self, variable: "TPUVariable") -> Any:
        return self.values[self._slot(variable)]

    def write(self, variable: "TPUVariable", value: Any) -> None:
        index = self._slot(variable)
        self.values[index] = value
        if index not in self.written:
            self.written.append(index)


def active_frame() -> Optional[TraceFrame]:
    """The frame of the step being traced on this thread, if any."""
    return getattr(_local, "frame", None)


class frame_active:
    """``with frame_active(frame):`` variables read and write ``frame`` inside the block."""

    def __init__(self, frame: TraceFrame):
        self._frame = frame

    def __enter__(self):
        self._saved = active_frame()
        _local.frame = self._frame
        return self._frame

    def __exit__(self, *exc):
        _local.frame = self._saved


def _is_jax(value: Any) -> bool:
    return array_kind(value) == "jax"


class TPUVariable(Variable):
    """A ``Variable`` whose replicas are JAX arrays on every device (see the module doc)."""

    def __init__(self, *args, **kwargs):
        if active_frame() is not None:
            raise RuntimeError(
                "variables cannot be created inside TPUStrategy.run (a compiled step cannot "
                "create state); create them in strategy.scope() before the first run")
        super().__init__(*args, **kwargs)  # rank 0's initial value, then the setter below
        self._strategy.extended.register_variable(self)

    # -- storage ---------------------------------------------------------------
    @property
    def _value(self) -> np.ndarray:
        """Host copy of this rank's first replica (what base-class helpers read)."""
        return np.asarray(self._replicas()[0])

    @_value.setter
    def _value(self, host: np.ndarray) -> None:
        self._set_replicas([np.asarray(host)] * len(self._strategy.extended.local_replica_ids))

    def _set_replicas(self, values: List[Any]) -> None:
        self._storage = jax_bridge.global_from_local(values)
        self._shape = tuple(np.shape(values[0]))
        self._dtype = np.dtype(self._storage.dtype)
        self.signature = (f"variable {self.name} {self._dtype.str}", self._shape)  # run's key

    def _replicas(self) -> List[Any]:
        return jax_bridge.local_from_global(self._storage, scalar=not self._shape)

    def _host_replicas(self) -> List[np.ndarray]:
        return [np.asarray(v) for v in self._replicas()]

    def to_block(self, value: Any) -> Any:
        """A replica's value as its block of the stored global array (inside a step)."""
        return value[None] if not self._shape else value

    def from_block(self, block: Any) -> Any:
        """Inverse of ``to_block``."""
        return block[0] if not self._shape else block

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    def __len__(self):
        return self._shape[0]

    # -- reading -----------------------------------------------------------------
    def read_value(self) -> Any:
        """Inside ``run``: this replica's traced value. Outside: replica 0's JAX array
        (``ON_READ`` variables: the combined value, on the host)."""
        frame = active_frame()
        if frame is not None:
            return frame.read(self)
        if self.synchronization is VariableSynchronization.ON_READ:
            return self._combined()
        return self._replicas()[0]

    value = read_value

    def _combined(self) -> np.ndarray:
        replicas = self._host_replicas()
        if self.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._engine.broadcast(replicas[0], root=0)
        if self.aggregation is VariableAggregation.NONE:
            return super()._combined()  # raises, naming the variable
        total = self._engine.all_reduce(np.sum(replicas, axis=0, dtype=self.dtype), ReduceOp.SUM)
        if self.aggregation is VariableAggregation.MEAN:
            total = total / self._strategy.num_replicas_in_sync
        return np.asarray(total, dtype=self.dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        values = [x.read_value() if isinstance(x, Variable) else x for x in inputs]
        if method == "__call__" and "out" not in kwargs and any(_is_jax(v) for v in values):
            import jax.numpy as jnp
            return getattr(jnp, ufunc.__name__)(*values, **kwargs)
        values = [np.asarray(v) if _is_jax(v) else v for v in values]
        return super().__array_ufunc__(ufunc, method, *values, **kwargs)

    # -- writing -----------------------------------------------------------------
    def _update(self, value, apply: Callable, what: str) -> "TPUVariable":
        frame = active_frame()
        if frame is None:
            return self._update_cross_replica(value, apply, what)
        import jax.numpy as jnp
        value = jnp.asarray(value.read_value() if isinstance(value, Variable) else value)
        try:
            value = jnp.broadcast_to(value, self.shape).astype(self.dtype)
        except (ValueError, TypeError):
            raise ValueError(f"{what} on variable {self.name!r}: value of shape {value.shape} "
                             f"does not fit shape {self.shape}") from None
        frame.write(self, apply(frame.read(self), self._replica_update(value, what)).astype(
            self.dtype))
        return self

    def _replica_update(self, value: Any, what: str) -> Any:
        """The update of one replica inside a step, after the collective the rules require."""
        if (self.synchronization is VariableSynchronization.ON_READ
                or self.aggregation is VariableAggregation.NONE):
            return value
        if self.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return xla.broadcast_from(value, 0, jax_bridge.AXIS)
        self._refuse_integer_mean(what)
        return xla.all_reduce(value, _REDUCE[self.aggregation], jax_bridge.AXIS,
                              self._strategy.num_replicas_in_sync)

    def _update_cross_replica(self, value, apply: Callable, what: str) -> "TPUVariable":
        # a write outside a step is a cross-replica write, even outside any scope
        value = self._synchronised_update(self._fit(value, what), what, in_replica=False)
        if what == "assign":
            replicas = [value] * len(self._strategy.extended.local_replica_ids)
        else:
            replicas = [apply(old, value) for old in self._host_replicas()]
        self._set_replicas([np.asarray(v, dtype=self.dtype) for v in replicas])
        return self

    # -- display -----------------------------------------------------------------
    def __repr__(self) -> str:
        kind = ("SyncOnReadVariable" if self.synchronization is VariableSynchronization.ON_READ
                else "MirroredVariable")
        ids = self._strategy.extended.local_replica_ids
        body = ",\n".join(f"  {rid}: {self._describe(v)}"
                          for rid, v in zip(ids, self._host_replicas()))
        return f"{kind}:{{\n{body}\n}}"


def variable_values(variables: List[TPUVariable]) -> List[Any]:
    """The stored global arrays of ``variables`` (the step's inputs)."""
    return [v._storage for v in variables]


def store_written(variables: List[TPUVariable], indices: List[int], arrays: List[Any]) -> None:
    """Put the arrays a step wrote back into their variables."""
    for index, array in zip(indices, arrays):
        variables[index]._storage = array

