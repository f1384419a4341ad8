"""``TPUStrategy.run``: ``fn`` compiled once per input signature, run on every replica.

A step is ``jit(shard_map(body))`` over the one-axis replica mesh. The
arguments of ``run`` are sorted into three groups:

* *per-replica* (``PerReplica`` / ``Mirrored``): the local components become
  one global array ``(replicas, *shape)``, split over the mesh, so each
  replica sees its own component;
* *replicated* (arrays and numbers): every replica sees the same value;
* *static* (anything else, and ``ms.Variable`` objects): passed to ``fn`` as
  they are, part of the cache key.

Every variable of the strategy enters the step too; the ones ``fn`` writes
come back out and replace the stored arrays. Outputs are ``PerReplica``
values over the local devices. Before running, the ranks agree on the
signature (one small MPI all-reduce), so a rank with other shapes gets an
error naming it instead of a hang in XLA's collectives; a step that fails to
trace on any rank raises on every rank. Outputs are ``DevicePerReplica``
values: split per device only when read.
"""

import gc
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from mpistrat.collectives.validation import format_ranks
from mpistrat.distribute.context import entered
from mpistrat.distribute.tpu_variables import (TraceFrame, frame_active, store_written,
                                               variable_values)
from mpistrat.distribute.values import DistributedValues, PerReplica
from mpistrat.distribute.variables import Variable
from mpistrat.errors import InvalidArgumentError
from mpistrat.runtime import jax_bridge
from mpistrat.runtime.devices import array_kind

__all__ = ["StepCache", "DevicePerReplica"]

_NUMBERS = (bool, int, float, complex, np.generic, np.ndarray)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, Variable))


def _is_array(x: Any) -> bool:
    return isinstance(x, _NUMBERS) or array_kind(x) == "jax"


def _static_key(x: Any) -> Any:
    try:
        hash(x)
        return ("value", type(x).__qualname__, x)
    except TypeError:
        return ("id", id(x))


class DevicePerReplica(PerReplica):
    """A step's output: the global device array, split into per-device components only
    when someone asks for them (``values``); passed back into ``run`` it is used as is."""

    def __init__(self, array: Any, scalar: bool, replica_ids):
        self._device_array = array
        self._scalar = scalar
        self._replica_ids = tuple(replica_ids)
        self._split: Any = None
        rows = array.shape[0] // jax_bridge.topology().num_replicas if array.ndim else 0
        self._spec = (np.dtype(array.dtype).str,
                      () if scalar else (rows,) + tuple(array.shape[1:]))

    @property
    def _values(self) -> Tuple[Any, ...]:
        if self._split is None:
            self._split = tuple(jax_bridge.local_from_global(self._device_array, self._scalar))
        return self._split

    def __len__(self) -> int:
        return len(self._replica_ids)


def _component_spec(value: DistributedValues) -> Tuple[str, Tuple[int, ...]]:
    if type(value) is DevicePerReplica:
        return value._spec
    first = value.values[0]
    dtype, shape = getattr(first, "dtype", None), getattr(first, "shape", None)
    if dtype is not None and shape is not None and all(
            getattr(c, "dtype", None) == dtype and getattr(c, "shape", None) == shape
            for c in value.values[1:]):
        return np.dtype(dtype).str, tuple(shape)  # the common case: arrays alike
    specs = {(np.asarray(c).dtype.str, tuple(np.shape(c))) for c in value.values}
    if len(specs) > 1:  # reported after the ranks agree, so that no rank leaves alone
        described = "; ".join(f"replica {rid}: {np.asarray(c).dtype}{list(np.shape(c))}"
                              for rid, c in zip(value.replica_ids, value.values))
        return "uneven", (described,)
    return specs.pop()


class _Step:
    """One compiled program and what its trace learned (output structure, writes)."""

    def __init__(self):
        self.program = None
        self.out_tree = None
        self.scalar_outputs: List[bool] = []
        self.written: List[int] = []


class StepCache:
    """Compiled steps of one strategy, keyed by function and input signature."""

    def __init__(self, strategy):
        self._strategy = strategy
        self._steps: Dict[tuple, _Step] = {}

    def run(self, fn: Callable, args, kwargs) -> Any:
        import jax
        strategy = self._strategy
        extended = strategy.extended
        leaves, treedef = jax.tree_util.tree_flatten((list(args), kwargs), is_leaf=_is_leaf)
        kinds, per_replica, replicated, statics, signature = [], [], [], [], []
        uneven = None
        for leaf in leaves:
            if isinstance(leaf, DistributedValues):
                if len(leaf) != len(extended.local_replica_ids):
                    raise ValueError(
                        f"{type(leaf).__name__} with {len(leaf)} components passed to "
                        f"TPUStrategy.run, but this host runs {len(extended.local_replica_ids)} "
                        f"replicas; make it with this strategy's "
                        f"experimental_distribute_values_from_function or datasets")
                dtype, shape = _component_spec(leaf)
                kinds.append("p")
                per_replica.append(leaf)
                signature.append((dtype, ()) if dtype == "uneven" else
                                 ("per-replica " + dtype, shape))
                if dtype == "uneven":
                    uneven = shape[0]
            elif _is_array(leaf):
                array = leaf if hasattr(leaf, "dtype") else np.asarray(leaf)
                kinds.append("r")
                replicated.append(leaf)
                weak = "" if hasattr(leaf, "dtype") else " weak"
                signature.append((f"replicated {np.dtype(array.dtype).str}{weak}",
                                  tuple(np.shape(array))))
            else:
                kinds.append("s")
                statics.append(leaf)
                signature.append(("static " + type(leaf).__qualname__, ()))
        variables = extended.live_variables()
        full = tuple(signature) + tuple(v.signature for v in variables)
        what = f"TPUStrategy.run({getattr(fn, '__qualname__', type(fn).__name__)})"
        agreed = extended.engine.start_agree(what, full)

        def settle():
            """Wait for the agreement; where it fails, collect garbage and agree once more.

            A variable the program dropped inside a reference cycle lives on until the cyclic
            collector runs, whose timing is each rank's own. A failed agreement raises on every
            rank together, so every rank collects and agrees again (a real mismatch raises
            again, on every rank); then ``variables`` and ``full`` are the collected ones."""
            nonlocal variables, full
            try:
                agreed()
                return False
            except InvalidArgumentError:
                variables = None   # (our own reference must not keep it alive)
                gc.collect()
                variables = extended.live_variables()
                full = tuple(signature) + tuple(v.signature for v in variables)
                extended.engine.agree(what, full)
                return True

        if uneven:
            settle()  # every rank has uneven components too, or a mismatch error names ranks
            raise InvalidArgumentError(
                f"{what} needs the same shape and dtype on every replica (static shapes, as "
                f"on TPUs), but this rank's components differ: {uneven}")
        arguments = ([v._device_array if v._device_array is not None else
                      jax_bridge.global_from_local(list(v.values)) for v in per_replica],
                     replicated)
        values = variable_values(variables)  # while the probe travels
        if settle():  # raises on every rank if any rank passed other shapes
            values = variable_values(variables)
        inputs = arguments + (values,)
        key = (fn, treedef, full, tuple(_static_key(s) for s in statics),
               tuple(id(v) for v in variables))
        step = self._steps.get(key)
        if step is None:
            scalars = [not shape for (_, shape), k in zip(signature, kinds) if k == "p"]
            step = self._trace(fn, treedef, kinds, scalars, statics, variables, inputs, what)
            self._steps[key] = step
        # (Dispatching a program without collectives before the probe completes was tried and
        # measured slower here: MPI's busy wait then competes with XLA's threads for the cores.)
        outputs, written = step.program(*inputs)
        jax.block_until_ready((outputs, written))  # many steps in flight can stall gloo
        store_written(variables, step.written, written)
        ids = extended.local_replica_ids
        results = [DevicePerReplica(o, scalar, ids)
                   for o, scalar in zip(outputs, step.scalar_outputs)]
        return jax.tree_util.tree_unflatten(step.out_tree, results)

    def _trace(self, fn, treedef, kinds, scalars, statics, variables, inputs, what) -> _Step:
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec
        strategy = self._strategy
        step = _Step()

        def body(per_replica, replicated, values):
            blocks = iter([b[0] if scalar else b for b, scalar in zip(per_replica, scalars)])
            it_r, it_s = iter(replicated), iter(statics)
            leaves = [next(blocks) if k == "p" else next(it_r) if k == "r" else next(it_s)
                      for k in kinds]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            frame = TraceFrame(variables, [v.from_block(b) for v, b in zip(variables, values)])
            with frame_active(frame), entered(strategy, strategy.extended.replica_context()):
                result = fn(*args, **kwargs)
                out_leaves, step.out_tree = jax.tree_util.tree_flatten(result, is_leaf=_is_leaf)
                out_leaves = [x.read_value() if isinstance(x, Variable) else x
                              for x in out_leaves]  # a returned variable: its value
            step.written = list(frame.written)
            out_leaves = [jnp.asarray(x) for x in out_leaves]
            step.scalar_outputs = [x.ndim == 0 for x in out_leaves]
            return ([x[None] if x.ndim == 0 else x for x in out_leaves],
                    [variables[i].to_block(frame.values[i]) for i in frame.written])

        axis = PartitionSpec(jax_bridge.AXIS)
        mapped = jax.shard_map(body, mesh=jax_bridge.mesh(), check_vma=False,
                               in_specs=(axis, PartitionSpec(), axis), out_specs=axis)
        error = None
        step.program = jax.jit(mapped)
        try:
            step.program.lower(*inputs)  # traces now, so every rank learns of a failure;
        except Exception as err:  # noqa: BLE001 -- every rank must learn of it
            error = err
        self._raise_if_any_failed(error, what)  # the call below reuses this trace
        return step

    def _raise_if_any_failed(self, error, what: str) -> None:
        engine = self._strategy.extended.engine
        texts = engine.allgather_object(None if error is None else f"{type(error).__name__}: "
                                        f"{error}", f"{what}: whether tracing failed")
        failed = [r for r, t in enumerate(texts) if t]
        if not failed:
            return
        if error is not None:
            raise error
        raise InvalidArgumentError(f"{what}: tracing failed on {format_ranks(failed)}: "
                                   f"{texts[failed[0]]}")
