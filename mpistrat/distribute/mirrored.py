"""``MirroredStrategy`` (the ranks of one node) and ``MultiWorkerMirroredStrategy`` (all ranks).

Both keep one replica per MPI rank and follow the input and collective
semantics of TensorFlow's ``MultiWorkerMirroredStrategy`` with one device
per worker. Launch with ``mpirun -n 4 python train.py``::

    >>> import mpistrat as ms
    >>> strategy = ms.MirroredStrategy()
    >>> strategy.num_replicas_in_sync         # doctest: +SKIP
    4
"""

from typing import Optional, Sequence

from mpistrat.cluster_resolver import MPIClusterResolver
from mpistrat.collectives import CollectiveEngine, CommunicationOptions
from mpistrat.distribute.strategy import Strategy
from mpistrat.runtime import get_world

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy"]


def _device_name(task: int, device: str) -> str:
    device = device.split("device:")[-1].lstrip("/").upper()
    return f"/job:worker/replica:0/task:{task}/device:{device}"


class MirroredStrategy(Strategy):
    """Synchronous training on the ranks of one node, one replica per rank.

    ``devices``: optional device names, one per rank of the node (so
    ``MirroredStrategy(["GPU:0", "GPU:1"])`` runs under ``mpirun -n 2``).
    ``cross_device_ops``: ``None`` or a ``CommunicationOptions``.
    Launched across several nodes it raises ``ValueError``: use
    ``MultiWorkerMirroredStrategy`` there.
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, cross_device_ops=None):
        world = get_world()
        if world.num_nodes > 1:
            raise ValueError(
                f"MirroredStrategy spans the ranks of one node, but this job runs on "
                f"{world.num_nodes} nodes ({world.describe()}); use "
                f"ms.MultiWorkerMirroredStrategy() to train across nodes")
        if cross_device_ops is not None and not isinstance(cross_device_ops, CommunicationOptions):
            raise ValueError("cross_device_ops must be None or an ms.CommunicationOptions, "
                             f"got {type(cross_device_ops).__name__}")
        if devices is not None:
            devices = list(devices)
            if len(devices) != world.local_size:
                raise ValueError(
                    f"MirroredStrategy got {len(devices)} devices but {world.local_size} ranks "
                    f"run on this node; mpistrat runs one replica per rank, so launch with "
                    f"mpirun -n {len(devices)} (or pass devices=None)")
            device = devices[world.local_rank]
        else:
            device = "CPU:0"
        engine = CollectiveEngine(world.node_comm, cross_device_ops)
        super().__init__(engine, (_device_name(world.rank, device),))


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training across all ranks of the job, one replica per rank.

    ``cluster_resolver``: defaults to ``MPIClusterResolver()``.
    ``communication_options``: a ``CommunicationOptions`` (bucket size,
    timeout, implementation).
    """

    def __init__(self, cluster_resolver=None, communication_options=None):
        world = get_world()
        resolver = cluster_resolver if cluster_resolver is not None else MPIClusterResolver()
        resolver.check_matches_world(world)
        if communication_options is not None and \
                not isinstance(communication_options, CommunicationOptions):
            raise ValueError("communication_options must be an ms.CommunicationOptions, got "
                             f"{type(communication_options).__name__}")
        engine = CollectiveEngine(world.comm, communication_options)
        super().__init__(engine, (_device_name(world.rank, "CPU:0"),), cluster_resolver=resolver)
