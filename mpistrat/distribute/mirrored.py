"""``MirroredStrategy`` (the ranks of one node) and ``MultiWorkerMirroredStrategy`` (all ranks).

Both keep one replica per MPI rank and follow the input and collective
semantics of TensorFlow's ``MultiWorkerMirroredStrategy`` with one device
per worker. Making a strategy binds the rank to its GPU (local rank modulo
the visible GPUs) before any CUDA work, or to its host when there is no GPU.
Launch with ``mpirun -n 4 python train.py``::

    >>> import mpistrat as ms
    >>> strategy = ms.MirroredStrategy()
    >>> strategy.num_replicas_in_sync         # doctest: +SKIP
    4
"""

from typing import Optional, Sequence

from mpistrat.cluster_resolver import MPIClusterResolver
from mpistrat.collectives import CollectiveEngine, CommunicationImplementation
from mpistrat.distribute.cross_device_ops import as_communication_options
from mpistrat.distribute.strategy import Strategy
from mpistrat.runtime import get_world
from mpistrat.runtime.gpus import bind_device

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy"]


def _device_name(task: int, device: str) -> str:
    device = device.split("device:")[-1].lstrip("/").upper()
    return f"/job:worker/replica:0/task:{task}/device:{device}"


def _check_nccl(options, bound) -> None:
    """Refuse ``implementation=NCCL`` where it cannot be honoured, saying why."""
    if options is None or options.implementation is not CommunicationImplementation.NCCL:
        return
    if bound.kind != "GPU":
        raise ValueError(f"implementation=NCCL (or NcclAllReduce) needs GPU replicas, but this "
                         f"rank's replica is its host ({bound.reason}); use "
                         f"CommunicationImplementation.AUTO or MPI")
    from mpistrat.runtime.devices import cupy_available, nccl_available
    available, why = nccl_available()
    if not (available and cupy_available()):
        raise ValueError(f"implementation=NCCL (or NcclAllReduce) cannot run here: {why}; use "
                         f"CommunicationImplementation.AUTO, which stages through host memory")


class MirroredStrategy(Strategy):
    """Synchronous training on the ranks of one node, one replica per rank.

    ``devices``: optional device names, one per rank of the node (so
    ``MirroredStrategy(["GPU:0", "GPU:1"])`` runs under ``mpirun -n 2``;
    local rank ``i`` takes ``devices[i]``). ``cross_device_ops``: ``None``,
    a ``CommunicationOptions``, or ``ms.distribute.NcclAllReduce()``,
    ``HierarchicalCopyAllReduce()`` or ``ReductionToOneDevice()``.
    Launched across several nodes it raises ``ValueError``: use
    ``MultiWorkerMirroredStrategy`` there. ``cluster_resolver`` is an
    ``MPIClusterResolver`` (``task_id`` is the rank, ``task_type`` ``"worker"``).
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, cross_device_ops=None):
        world = get_world()
        if world.num_nodes > 1:
            raise ValueError(
                f"MirroredStrategy spans the ranks of one node, but this job runs on "
                f"{world.num_nodes} nodes ({world.describe()}); use "
                f"ms.MultiWorkerMirroredStrategy() to train across nodes")
        options = as_communication_options(cross_device_ops, "cross_device_ops")
        bound = bind_device(world, list(devices) if devices is not None else None)
        _check_nccl(options, bound)
        engine = CollectiveEngine(world.node_comm, options)
        # (one node: its ranks are the world's, so the MPI resolver describes them: the
        # tutorials' `strategy.cluster_resolver.task_id == 0` chief check works here too)
        super().__init__(engine, (_device_name(world.rank, bound.name),),
                         cluster_resolver=MPIClusterResolver())


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
        from mpistrat.collectives import CommunicationOptions
        if communication_options is not None and \
                not isinstance(communication_options, CommunicationOptions):
            raise ValueError("communication_options must be an ms.CommunicationOptions, got "
                             f"{type(communication_options).__name__}")
        bound = bind_device(world)
        _check_nccl(communication_options, bound)
        engine = CollectiveEngine(world.comm, communication_options)
        super().__init__(engine, (_device_name(world.rank, bound.name),),
                         cluster_resolver=resolver)
