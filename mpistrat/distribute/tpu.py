"""``TPUStrategy``: synchronous training on the JAX devices of every MPI rank.

Each rank is one JAX host (TPU, GPU or CPU devices, bootstrapped from MPI by
``runtime.jax_bridge``); every device of every host is one replica, so
``num_replicas_in_sync`` is ``ranks x local devices``. The upstream
initialisation works as it is::

    import mpistrat as ms
    resolver = ms.cluster_resolver.TPUClusterResolver(tpu='')
    ms.config.experimental_connect_to_cluster(resolver)
    ms.tpu.experimental.initialize_tpu_system(resolver)
    strategy = ms.TPUStrategy(resolver)

    def step(x):
        ctx = ms.get_replica_context()
        return ctx.all_reduce("SUM", x * 2)        # an XLA collective

    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    out = strategy.run(step, args=(per_replica,))  # PerReplica over local devices
    strategy.reduce("SUM", out, axis=None)         # on the host, every rank

``run`` compiles ``fn`` (``tpu_run``); ``reduce`` and ``gather`` run in
cross-replica context on the host through MPI, as TensorFlow copies their
results to the host CPU; ``gather`` requires identical shapes on every
replica, as the upstream page says.
"""

import weakref
from typing import Any, Callable, List

import numpy as np

from mpistrat import nest
from mpistrat.cluster_resolver import TPUClusterResolver
from mpistrat.collectives import CollectiveEngine, ReduceOp, xla
from mpistrat.distribute.context import current_strategy_entry, entered
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy import Strategy, StrategyExtended
from mpistrat.distribute.tpu_run import StepCache
from mpistrat.distribute.tpu_variables import TPUVariable, active_frame
from mpistrat.errors import InvalidArgumentError
from mpistrat.runtime import get_world, jax_bridge

__all__ = ["TPUStrategy", "TPUStrategyExtended", "TPUReplicaContext"]


class TPUReplicaContext(ReplicaContext):
    """The replica context inside ``TPUStrategy.run``: ids and collectives are traced."""

    def __init__(self, strategy):
        super().__init__(strategy, 0)

    @property
    def replica_id_in_sync_group(self):
        """This replica's global id, a traced ``int32`` (as on TPUs)."""
        return xla.replica_id(jax_bridge.AXIS)

    def all_reduce(self, reduce_op, value: Any, options=None):
        """Combine over all replicas with an XLA collective (``MEAN`` divides by the count)."""
        return xla.all_reduce(_read_variables(value), reduce_op, jax_bridge.AXIS,
                              self.num_replicas_in_sync)

    def all_gather(self, value: Any, axis: int, options=None):
        """Concatenate over all replicas along ``axis`` with an XLA collective."""
        return xla.all_gather(_read_variables(value), axis, jax_bridge.AXIS)

    def merge_call(self, merge_fn: Callable, args=(), kwargs=None):
        """Call ``merge_fn(strategy, ...)``; inside it ``strategy.reduce`` / ``gather``
        are XLA collectives (every replica runs ``merge_fn``, in SPMD)."""
        with entered(self._strategy, None):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"TPUReplicaContext(num_replicas_in_sync={self.num_replicas_in_sync})"


def _read_variables(value: Any) -> Any:
    import jax
    return jax.tree_util.tree_map(lambda x: x.read_value() if isinstance(x, TPUVariable) else x,
                                  value, is_leaf=lambda x: isinstance(x, TPUVariable))


class TPUStrategyExtended(StrategyExtended):
    """``strategy.extended`` of a ``TPUStrategy``: replicas are devices, shapes static."""

    variable_class = TPUVariable
    replicas_in_compiled_steps = True

    def __init__(self, strategy, engine, worker_devices, topology):
        super().__init__(strategy, engine, worker_devices)
        self.topology = topology
        self.experimental_require_static_shapes = True
        first, last = jax_bridge.local_replica_range()
        self._local_ids = tuple(range(first, last))
        self._variables: List[weakref.ref] = []
        self.steps = StepCache(strategy)

    @property
    def num_replicas_in_sync(self) -> int:
        return self.topology.num_replicas

    @property
    def local_replica_ids(self):
        """Global ids of this host's replicas: ``rank * L + i``."""
        return self._local_ids

    @property
    def default_prefetch_depth(self) -> int:
        """Batches a dataset prepares ahead in a thread: 1 on accelerators; none on CPU
        devices, where that thread competes with the devices for the same cores."""
        return 0 if self.topology.platform == "cpu" else 1

    def stage_per_replica(self, parts) -> Any:
        """This host's per-replica values as one global device array (used by datasets to
        prepare the next batch on the devices while the current step runs)."""
        return jax_bridge.global_from_local(list(parts))

    def replica_context(self) -> TPUReplicaContext:
        return TPUReplicaContext(self._container_strategy)

    def register_variable(self, variable: TPUVariable) -> None:
        self._variables.append(weakref.ref(variable))

    def live_variables(self) -> List[TPUVariable]:
        """The strategy's variables still referenced somewhere, in creation order."""
        alive = [v for v in (ref() for ref in self._variables) if v is not None]
        if len(alive) != len(self._variables):
            self._variables = [weakref.ref(v) for v in alive]
        return alive


class TPUStrategy(Strategy):
    """Synchronous training over every JAX device of every rank (see the module doc).

    ``tpu_cluster_resolver``: a ``TPUClusterResolver`` (default: one for this
    MPI job). ``device_assignment``: not supported (``NotImplementedError``):
    JAX gives every replica one device of a one-axis mesh.
    """

    def __init__(self, tpu_cluster_resolver=None, device_assignment=None,
                 experimental_spmd_xla_partitioning=False):
        if device_assignment is not None:
            raise NotImplementedError(
                "TPUStrategy(device_assignment=...) is not supported: mpistrat runs one "
                "replica per JAX device on a one-axis mesh; for model parallelism use "
                "jax.sharding inside your step")
        if experimental_spmd_xla_partitioning:
            raise NotImplementedError("experimental_spmd_xla_partitioning is not supported")
        world = get_world()
        resolver = tpu_cluster_resolver if tpu_cluster_resolver is not None \
            else TPUClusterResolver()
        resolver.check_matches_world(world)
        topology = jax_bridge.initialize()
        platform = topology.platform.upper()
        devices = tuple(f"/job:worker/replica:0/task:{world.rank}/device:{platform}:{i}"
                        for i in range(topology.num_devices_per_task))
        engine = CollectiveEngine(world.comm)
        super().__init__(engine, devices, cluster_resolver=resolver)
        self._extended = TPUStrategyExtended(self, engine, devices, topology)

    # -- running -------------------------------------------------------------
    def run(self, fn: Callable, args=(), kwargs=None, options=None):
        """Run ``fn`` on every replica as one compiled XLA program.

        Returns ``PerReplica`` values (one JAX array per local device) in the
        structure ``fn`` returns. Shapes must be static: the same on every
        replica, or ``ValueError`` names the ranks.
        """
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"run: args must be a list or tuple, got {type(args).__name__}; "
                             f"write args=(x,) for a single argument")
        self._require_cross_replica("run")
        return self._extended.steps.run(fn, args, kwargs or {})

    # -- cross-replica collectives ------------------------------------------
    def reduce(self, reduce_op, value: Any, axis):
        """As ``Strategy.reduce``; inside ``merge_call`` of a step, an XLA collective."""
        if active_frame() is not None:
            return self._traced_reduce(reduce_op, value, axis)
        return super().reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int):
        """Concatenate along ``axis`` in replica order; shapes must be identical everywhere."""
        if active_frame() is not None:
            return xla.all_gather(_read_variables(value), axis, jax_bridge.AXIS)
        self._require_cross_replica("gather")
        components = self.experimental_local_results(value)
        arrays = [[np.asarray(x) for x in nest.flatten(c)] for c in components]
        signature = tuple((a.dtype.str, a.shape) for a in arrays[0])
        for rid, leaves in zip(self._extended.local_replica_ids, arrays):
            if tuple((a.dtype.str, a.shape) for a in leaves) != signature:
                raise InvalidArgumentError(
                    f"TPUStrategy.gather needs identical shapes on every replica, but replica "
                    f"{rid} has {[a.shape for a in leaves]} and replica "
                    f"{self._extended.local_replica_ids[0]} has {[a.shape for a in arrays[0]]}")
        try:
            self._extended.engine.agree(f"TPUStrategy.gather axis={axis}", signature)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(
                f"TPUStrategy.gather needs identical shapes on every replica: {err}") from None
        return super().gather(value, axis)

    def _traced_reduce(self, reduce_op, value, axis):
        entry = current_strategy_entry()
        if entry is None or entry.replica_context is not None:
            raise RuntimeError("TPUStrategy.reduce must be called in cross-replica context: "
                               "inside run, call it through ms.get_replica_context()."
                               "merge_call, or use all_reduce")
        op = ReduceOp.from_any(reduce_op)
        value = _read_variables(value)
        if axis is None:
            return xla.all_reduce(value, op, jax_bridge.AXIS, self.num_replicas_in_sync)
        import jax
        import jax.numpy as jnp
        if op is ReduceOp.MEAN:
            total = xla.all_reduce(jax.tree_util.tree_map(lambda x: jnp.sum(x, axis), value),
                                   ReduceOp.SUM, jax_bridge.AXIS, 1)
            rows = jax.tree_util.tree_map(lambda x: x.shape[axis] * self.num_replicas_in_sync,
                                          value)
            return jax.tree_util.tree_map(lambda t, n: t / n, total, rows)
        local = {ReduceOp.SUM: jnp.sum, ReduceOp.MIN: jnp.min, ReduceOp.MAX: jnp.max}[op]
        return xla.all_reduce(jax.tree_util.tree_map(lambda x: local(x, axis), value), op,
                              jax_bridge.AXIS, 1)

    # -- logical devices: no JAX counterpart -----------------------------------
    def _no_logical_devices(self, name: str):
        raise NotImplementedError(
            f"TPUStrategy.{name} is not supported: mpistrat maps one replica to one JAX device "
            f"and has no logical-device (model parallel) assignment; shard inside your step "
            f"with jax.sharding instead")

    def experimental_assign_to_logical_device(self, tensor, logical_device_id):
        self._no_logical_devices("experimental_assign_to_logical_device")

    def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
        self._no_logical_devices("experimental_split_to_logical_devices")

    def experimental_replicate_to_logical_devices(self, tensor):
        self._no_logical_devices("experimental_replicate_to_logical_devices")

