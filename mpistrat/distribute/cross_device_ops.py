"""TensorFlow's ``cross_device_ops`` for ``MirroredStrategy``, mapped to our backends.

=============================  =========================================================
TensorFlow                     mpistrat
=============================  =========================================================
``NcclAllReduce()``            device arrays through NCCL (``implementation=NCCL``)
``HierarchicalCopyAllReduce``  the hierarchical all-reduce (reduce in nodes, then across)
``ReductionToOneDevice()``     ``Reduce`` to rank 0, then ``Bcast``
=============================  =========================================================

``num_packs=0`` turns fusion of small tensors off; any other value keeps
mpistrat's fusion by size (``bytes_per_pack``)::

    >>> import mpistrat as ms
    >>> ms.distribute.HierarchicalCopyAllReduce().communication_options().algorithm
    'hierarchical'
"""

from mpistrat.collectives import CommunicationImplementation, CommunicationOptions

__all__ = ["CrossDeviceOps", "NcclAllReduce", "HierarchicalCopyAllReduce",
           "ReductionToOneDevice", "as_communication_options"]


class CrossDeviceOps:
    """Base class: how a strategy's collectives run, as ``CommunicationOptions``."""

    implementation = CommunicationImplementation.AUTO
    algorithm = "auto"

    def __init__(self, num_packs: int = 1):
        if not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(f"num_packs must be a non-negative int, got {num_packs!r}")
        self.num_packs = num_packs

    def communication_options(self) -> CommunicationOptions:
        """The options the strategy's engine runs with."""
        return CommunicationOptions(bytes_per_pack=1 if self.num_packs == 0 else 0,
                                    implementation=self.implementation, algorithm=self.algorithm)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce through NCCL; needs GPU replicas (refused on host replicas, naming why)."""

    implementation = CommunicationImplementation.NCCL


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduce inside each node, all-reduce across nodes, share inside each node."""

    algorithm = "hierarchical"


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce to one replica (rank 0), then broadcast the result to all."""

    algorithm = "reduce_broadcast"

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        super().__init__(num_packs=1)
        if accumulation_fn is not None:
            raise ValueError("ReductionToOneDevice(accumulation_fn=...) is not supported: "
                             "values are combined by MPI's reduction")
        self.reduce_to_device = reduce_to_device


def as_communication_options(value, what: str):
    """``None``, ``CommunicationOptions`` or a ``CrossDeviceOps``, as options (or ``None``)."""
    if value is None or isinstance(value, CommunicationOptions):
        return value
    if isinstance(value, CrossDeviceOps):
        return value.communication_options()
    raise ValueError(f"{what} must be None, an ms.CommunicationOptions or one of "
                     f"ms.distribute.NcclAllReduce, HierarchicalCopyAllReduce, "
                     f"ReductionToOneDevice; got {type(value).__name__}")
