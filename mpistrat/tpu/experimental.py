"""``ms.tpu.experimental``: start and stop the JAX hosts of the job.

``initialize_tpu_system`` bootstraps JAX's multi-process runtime from MPI
(``runtime.jax_bridge``) and returns the topology; call it on every rank,
before any other JAX call::

    import mpistrat as ms
    resolver = ms.cluster_resolver.TPUClusterResolver(tpu='')
    topology = ms.tpu.experimental.initialize_tpu_system(resolver)
    topology.num_tasks, topology.num_devices_per_task        # (2, 4) on 2 ranks
"""

from mpistrat.runtime import get_world, jax_bridge

__all__ = ["initialize_tpu_system", "shutdown_tpu_system", "Topology", "DeviceAssignment"]

Topology = jax_bridge.Topology


def initialize_tpu_system(cluster_resolver=None) -> Topology:
    """Start JAX on every rank (collective, idempotent); returns the ``Topology``."""
    if cluster_resolver is not None:
        cluster_resolver.check_matches_world(get_world())
    return jax_bridge.initialize()


def shutdown_tpu_system(cluster_resolver=None) -> None:
    """Stop JAX's distributed runtime (collective); it cannot start again in this process."""
    jax_bridge.shutdown()


class DeviceAssignment:
    """Not supported: every replica is one JAX device of a one-axis mesh."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "DeviceAssignment is not supported: mpistrat runs one replica per JAX device on a "
            "one-axis mesh; shard inside your step with jax.sharding for model parallelism")

    @staticmethod
    def build(*args, **kwargs):
        DeviceAssignment()
