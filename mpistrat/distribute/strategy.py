"""``Strategy``: the ``tf.distribute.Strategy`` API with one replica per MPI rank.

Subclasses (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``) only
choose the communicator and the cluster; the semantics live here::

    >>> import mpistrat as ms
    >>> strategy = ms.MultiWorkerMirroredStrategy()
    >>> with strategy.scope():
    ...     v = ms.Variable(1.0)
    >>> def step(x):
    ...     return x * 2
    >>> out = strategy.run(step, args=(float(strategy.extended.local_replica_ids[0]),))
    >>> strategy.reduce("SUM", out, axis=None)            # doctest: +SKIP
    np.float64(2.0)                                       # on 2 ranks: 0*2 + 1*2
"""

import contextlib
import itertools
import weakref
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from mpistrat import nest
from mpistrat.collectives import CollectiveEngine, ReduceOp
from mpistrat.collectives.dtypes import check_reducible, dtype_code
from mpistrat.collectives.structure import flatten
from mpistrat.distribute import input_lib
from mpistrat.distribute.context import ValueContext, current_strategy_entry, entered
from mpistrat.distribute.reduction import (LazyNames, as_array, combine_local, mean, partial,
                                           restore, same_shapes)
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.scalar_results import scalars_to_numpy
from mpistrat.distribute.values import DistributedValues, Mirrored, PerReplica, local_component
from mpistrat.runtime.devices import array_module

__all__ = ["Strategy", "StrategyExtended"]


_COUNTER = itertools.count()
_SCOPE_HOOKS = []   # callables run on every scope() entry, registered by higher layers
_LIVE: "weakref.WeakSet" = weakref.WeakSet()   # every strategy made in this process, alive


_NEWEST_TIMEOUT: list = [None]   # timeout_seconds of the newest strategy made on every rank


def newest_timeout() -> Optional[float]:
    """``timeout_seconds`` of the newest strategy the job made (every rank makes its strategies
    in the same order, so every rank answers alike, whatever its garbage collector kept);
    ``None`` when it gave none, or none was made. The default strategy does not count."""
    return _NEWEST_TIMEOUT[0]


def live_strategies() -> list:
    """The strategies of this process that are still referenced, oldest first."""
    return sorted(_LIVE, key=lambda s: s._created)


def add_scope_hook(hook: Callable[[], None]) -> None:
    """Run ``hook()`` whenever a strategy is made or its scope is entered (once per hook).

    Higher layers register here so that this layer never imports them::

        add_scope_hook(hooks.on_scope)   # done by mpistrat/keras/hooks.py
    """
    if hook not in _SCOPE_HOOKS:
        _SCOPE_HOOKS.append(hook)


class StrategyExtended:
    """Lower-level facts and tools of a strategy (``strategy.extended``)."""

    #: Whether the replicas are devices inside compiled steps (``TPUStrategy``: XLA
    #: collectives in ``strategy.run``), not one replica per rank on the host. Code that runs
    #: per rank on the host (Keras's ``fit``, ``ms.nn``'s host all-reduce, host-kept variable
    #: values) asks this, not which variable class the strategy makes.
    replicas_in_compiled_steps = False

    @property
    def _container_strategy(self) -> "Strategy":
        return self._strategy_ref()

    def __init__(self, strategy: "Strategy", engine: CollectiveEngine,
                 worker_devices: Tuple[str, ...]):
        self._strategy_ref = weakref.ref(strategy)   # no cycle: a dropped strategy dies at
                                                      # once (live_strategies must not see it)
        self.engine = engine
        self.worker_devices = tuple(worker_devices)
        self.parameter_devices = self.worker_devices
        self.experimental_require_static_shapes = False

    @property
    def num_replicas_in_sync(self) -> int:
        return self.engine.size

    @property
    def local_replica_ids(self) -> Tuple[int, ...]:
        """Global ids of the replicas this rank runs (one per rank here)."""
        return (self.engine.rank,)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoint metadata (the first one)."""
        return self.engine.rank == 0

    should_save_summary = should_checkpoint

    @property
    def default_replica_context(self) -> ReplicaContext:
        return ReplicaContext(self._container_strategy, self.local_replica_ids[0])

    # -- reductions to destinations (tf.distribute.StrategyExtended) ----------
    def reduce_to(self, reduce_op, value: Any, destinations: Any, options=None):
        """Combine ``value`` across replicas and place the result on ``destinations``.

        As TensorFlow's: ``value`` is a ``DistributedValues`` (or a plain value,
        taken as this rank's replica value, as ``Strategy.reduce`` does);
        ``destinations`` a device string, a ``DistributedValues`` or a variable
        (``ValueError`` when empty). Every replica receives the element-wise
        result (``MEAN`` divides by ``num_replicas_in_sync``): a plain value
        with one local replica, a ``Mirrored`` with several. Cross-replica
        context only. ``options`` are per-call ``CommunicationOptions``::

            >>> import mpistrat as ms
            >>> s = ms.MultiWorkerMirroredStrategy()
            >>> s.extended.reduce_to("SUM", 1.0, destinations="/cpu:0")  # doctest: +SKIP
            np.float64(2.0)                                               # on 2 ranks
        """
        _check_destinations(destinations, "reduce_to")
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None) -> list:
        """``reduce_to`` for many ``(value, destinations)`` pairs in as few collectives
        as the fusion plan allows (one for small tensors of one dtype).

        Returns a list, one result per pair::

            >>> s.extended.batch_reduce_to("MEAN", [(g, "/cpu:0") for g in grads])  # doctest: +SKIP
        """
        strategy = self._container_strategy
        strategy._require_cross_replica("extended.batch_reduce_to")
        if not isinstance(value_destination_pairs, (list, tuple)) or any(
                not isinstance(p, (list, tuple)) or len(p) != 2 for p in value_destination_pairs):
            raise ValueError("batch_reduce_to: value_destination_pairs must be a list or tuple of "
                             "(value, destinations) pairs, got "
                             f"{type(value_destination_pairs).__name__}")
        for _, destinations in value_destination_pairs:
            _check_destinations(destinations, "batch_reduce_to")
        op = ReduceOp.from_any(reduce_op)
        values = [v for v, _ in value_destination_pairs]
        if not values:
            return []
        ids = self.local_replica_ids
        if len(ids) == 1:  # one replica per rank: one engine call over every value
            results = self.engine.all_reduce([_local(v) for v in values], op, options)
            return list(scalars_to_numpy(results))
        results = strategy._reduce_components(op, strategy.experimental_local_results(values),
                                              None, options)
        return [Mirrored([r] * len(ids), ids) for r in results]


class Strategy:
    """Base class of the strategies; see the module docstring for an example."""

    _made_by_every_rank = True   # (the default strategy is made by each process alone)

    def __init__(self, engine: CollectiveEngine, worker_devices: Tuple[str, ...],
                 cluster_resolver: Any = None):
        self._extended = StrategyExtended(self, engine, worker_devices)
        self._cluster_resolver = cluster_resolver
        self._created = next(_COUNTER)
        _LIVE.add(self)
        if self._made_by_every_rank:
            _NEWEST_TIMEOUT[0] = engine.options.timeout_seconds
        for hook in _SCOPE_HOOKS:   # e.g. keras.hooks: guard fit of models made before
            hook()

    # -- facts ---------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        """Lower-level facts: ``worker_devices``, ``local_replica_ids``, ``engine``."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas that take part in collectives (ranks here)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self):
        """The cluster resolver the strategy was built from (``None`` if none)."""
        return self._cluster_resolver

    # -- contexts ------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Make this the current strategy; variables created inside are mirrored.

        Re-entrant; entering another strategy's scope inside raises ``RuntimeError``.
        """
        entry = current_strategy_entry()
        if entry is not None and entry.strategy is not self:
            raise RuntimeError(
                f"Mixing different strategies: {type(entry.strategy).__name__} is current, "
                f"so the scope of this {type(self).__name__} cannot be entered inside it")
        for hook in _SCOPE_HOOKS:   # e.g. keras.hooks: model.fit under a strategy
            hook()
        with entered(self, entry.replica_context if entry else None):
            yield self

    def _require_cross_replica(self, method: str) -> None:
        entry = current_strategy_entry()
        if entry is None:
            return
        if entry.strategy is not self:
            raise RuntimeError(f"{type(self).__name__}.{method} called inside the scope of "
                               f"another strategy ({type(entry.strategy).__name__})")
        if entry.replica_context is not None:
            raise RuntimeError(
                f"{type(self).__name__}.{method} must be called in cross-replica context, not "
                f"inside strategy.run; use ms.get_replica_context().all_reduce/all_gather there")

    # -- running -------------------------------------------------------------
    def run(self, fn: Callable, args=(), kwargs=None, options=None):
        """Run ``fn`` on this rank's replica; return its result as a plain value.

        ``PerReplica`` arguments are replaced by this replica's component.
        """
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"run: args must be a list or tuple, got {type(args).__name__}; "
                             f"write args=(x,) for a single argument")
        self._require_cross_replica("run")
        kwargs = kwargs or {}
        local_args = nest.map_structure(local_component, list(args))
        local_kwargs = nest.map_structure(local_component, kwargs)
        context = ReplicaContext(self, self._extended.local_replica_ids[0])
        with entered(self, context):
            return fn(*local_args, **local_kwargs)

    # -- cross-replica collectives -------------------------------------------
    def reduce(self, reduce_op, value: Any, axis: Optional[int]):
        """Combine ``value`` across replicas; every rank receives the result.

        ``axis=None``: element-wise (``MEAN`` divides by ``num_replicas_in_sync``).
        ``axis=k``: also reduce along dimension ``k``; ``MEAN`` divides by the
        total number of rows along ``k`` over all replicas.

        ``value`` may be any nest or JAX pytree (``nnx.State``, optax states, ...): the
        result has its structure, and each tensor comes back as the kind of array it was
        (NumPy, JAX on its device, CuPy) with its dtype, for both axis rules. Types MPI
        lacks (bfloat16, float8, float16) combine in float32 and round once; integer
        ``MEAN`` sums in 64 bits and truncates toward zero (``collectives/dtypes.py``).
        """
        self._require_cross_replica("reduce")
        if axis is None and len(self._extended.local_replica_ids) == 1:  # the common case
            engine = self._extended.engine
            total = engine.reduce_scalar(reduce_op, value)  # a loss, a count: one collective
            if total is not None:
                return total
            return scalars_to_numpy(engine.all_reduce(_local(value), ReduceOp.from_any(reduce_op)))
        return self._reduce_components(ReduceOp.from_any(reduce_op),
                                       self.experimental_local_results(value), axis)

    def gather(self, value: Any, axis: int):
        """Concatenate ``value`` from all replicas along ``axis``, in replica-id order.

        Shapes may differ along ``axis`` only; scalars raise ``ValueError``.
        """
        self._require_cross_replica("gather")
        if len(self._extended.local_replica_ids) > 1:  # this rank's replicas, in order
            components = self.experimental_local_results(value)
            flat = [flatten(c) for c in components]
            originals = flat[0][0]
            leaves = [[as_array(x) for x in f[0]] for f in flat]
            if any(a.ndim == 0 for a in leaves[0]) or any(
                    not -a.ndim <= axis < a.ndim for a in leaves[0]):
                return self._extended.engine.all_gather(_local(value), axis)  # raises together
            local = flat[0][1]([restore(array_module(parts[0]).concatenate(parts, axis=axis),
                                         like) for parts, like in zip(zip(*leaves), originals)])
        else:
            local = _local(value)
        return self._extended.engine.all_gather(local, axis)

    def _reduce_components(self, op: ReduceOp, components: tuple, axis: Optional[int],
                           options=None):
        """Reduce this rank's replicas' values (one nest each) here, then across ranks.

        Every step combines in ``dtypes.accumulator`` (float32 for bfloat16, 64 bits for an
        integer MEAN); each result is rounded once to its input's dtype and handed back as
        its kind of array (``_restore``)."""
        flat = [flatten(c) for c in components]
        originals, rebuild = flat[0]
        leaves = list(zip(*[[as_array(x) for x in f[0]] for f in flat]))
        engine = self._extended.engine
        ids = self._extended.local_replica_ids
        exact = op in (ReduceOp.SUM, ReduceOp.MEAN) and engine.is_deterministic(options)

        def done(results):
            return scalars_to_numpy(rebuild([restore(r, like) for r, like in
                                             zip(results, originals)]))

        if axis is None and exact and len(ids) > 1:  # the replicas' values are the rows
            for parts in leaves:
                same_shapes(parts, ids)
            return done(engine.exact_sum([np.stack(parts) for parts in leaves], 0, options,
                                         op)[0])
        if axis is None:
            combined = [combine_local(op, list(parts), ids) for parts in leaves]
            results = engine.all_reduce(combined, ReduceOp.SUM if op is ReduceOp.MEAN else op,
                                        options)
            if op is ReduceOp.MEAN:
                results = [mean(r, self.num_replicas_in_sync) for r in results]
            return done(results)
        bad = [i for i, parts in enumerate(leaves)
               if any(not -a.ndim <= axis < a.ndim for a in parts)]
        # Agree first, so that every rank raises together (never one rank alone).
        # (Rows along the axis may differ between replicas; the other dimensions may not.)
        engine.agree(f"reduce axis={axis}", tuple(
            (dtype_code(a.dtype) + " (axis out of range)", a.shape) if i in bad else
            (dtype_code(a.dtype), tuple(-1 if d == axis % a.ndim else n
                                        for d, n in enumerate(a.shape)))
            for i, a in enumerate(parts[0] for parts in leaves)))
        if bad:
            shapes = ", ".join(str(leaves[i][0].shape) for i in bad)
            raise ValueError(f"reduce: axis {axis} is out of range for value(s) of shape {shapes}")
        # the ranks agreed on every dtype: each raises the same refusal, together
        check_reducible(f"reduce {op.name} axis={axis}", [p[0] for p in leaves], op,
                        LazyNames(components[0]))
        if exact:  # every row a summand of one exact sum, wherever it lives
            rows_here = [parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
                         for parts in leaves]
            return done(engine.exact_sum(rows_here, axis, options, op)[0])
        partials = [combine_local(op, [partial(op, a, axis) for a in parts], ids)
                    for parts in leaves]
        if op is ReduceOp.MEAN:  # the global sum over the global number of rows along the axis
            rows = np.array([sum(a.shape[axis] for a in parts) for parts in leaves], np.int64)
            sums, totals = engine.all_reduce((partials, rows), ReduceOp.SUM)
            results = [mean(s, int(t)) for s, t in zip(sums, totals)]
        else:
            results = engine.all_reduce(partials, op)
        return done(results)

    # -- distributed values --------------------------------------------------
    def experimental_local_results(self, value: Any) -> tuple:
        """The local components of ``value``: one entry per local replica."""
        count = len(self._extended.local_replica_ids)
        return tuple(nest.map_structure(lambda v, i=i: local_component(v, i), value)
                     for i in range(count))

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> PerReplica:
        """Call ``value_fn(ValueContext)`` for each local replica; return a ``PerReplica``."""
        self._require_cross_replica("experimental_distribute_values_from_function")
        ids = self._extended.local_replica_ids
        values = [value_fn(ValueContext(rid, self.num_replicas_in_sync)) for rid in ids]
        return PerReplica(values, ids)

    # -- input (distribute/input_lib.py, over the datasets of the layer below) -------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Split each global batch of a batched ``ms.data.Dataset`` over the replicas.

        Iterating the result yields ``PerReplica`` batches for ``run``; all
        ranks stop on the same step (``input_lib.distribute_dataset``).
        """
        return input_lib.distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Call ``dataset_fn(InputContext)`` on each rank; no rebatching or sharding
        (``input_lib.distribute_datasets_from_function``)."""
        return input_lib.distribute_datasets_from_function(self, dataset_fn, options)

    def __repr__(self) -> str:
        return f"<mpistrat.{type(self).__name__} num_replicas_in_sync={self.num_replicas_in_sync}>"


def _check_destinations(destinations: Any, method: str) -> None:
    """TensorFlow's check: destinations may not be empty (``ValueError``), nor of a kind
    that names no device (``TypeError``)."""
    if destinations is None or (isinstance(destinations, (str, list, tuple))
                                and len(destinations) == 0):
        raise ValueError(f"{method}: destinations can not be empty; pass a device string, a "
                         f"variable or a DistributedValues (the value itself for an all-reduce)")
    if isinstance(destinations, (list, tuple)):
        if all(isinstance(d, str) for d in destinations):
            return
    elif isinstance(destinations, (str, DistributedValues, np.ndarray, np.generic, float, int)) \
            or any(hasattr(destinations, a) for a in ("device", "devices", "assign")):
        return
    raise TypeError(f"{method}: destinations must be a device string (or a list of them), a "
                    f"variable, a tensor or a DistributedValues, got {type(destinations).__name__}")


def _local(value: Any) -> Any:
    """This rank's component of every distributed value in a nest."""
    if type(value) in (list, tuple) and set(map(type, value)) <= _NDARRAY_ONLY:
        return value  # a plain list of arrays (the common case): nothing to look into
    if isinstance(value, (dict, list, tuple)):
        if any(isinstance(x, DistributedValues) for x in nest.flatten(value)):
            return nest.map_structure(local_component, value)
        return value
    return local_component(value)


_NDARRAY_ONLY = {np.ndarray}
