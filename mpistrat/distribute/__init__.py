"""Layer 3: distributed values, contexts, strategies and variables.

The names TensorFlow keeps under ``tf.distribute`` are here too::

    >>> import mpistrat as ms
    >>> ms.distribute.ReduceOp.SUM is ms.ReduceOp.SUM, ms.distribute.TPUStrategy is ms.TPUStrategy
    (True, True)
"""

from mpistrat.collectives import ReduceOp

from mpistrat.distribute.context import (InputContext, ValueContext, get_replica_context,
                                         get_strategy, has_strategy, in_cross_replica_context)
from mpistrat.distribute.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce,
                                                  NcclAllReduce, ReductionToOneDevice)
from mpistrat.distribute.default import DefaultStrategy  # registers the default strategy
from mpistrat.distribute.input_lib import DistributedDataset, DistributedIterator
from mpistrat.distribute.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from mpistrat.distribute.options import InputOptions, RunOptions
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.strategy import Strategy, StrategyExtended
from mpistrat.distribute.tpu import TPUStrategy
from mpistrat.distribute.values import DistributedValues, Mirrored, PerReplica
from mpistrat.distribute.variables import Variable, VariableAggregation, VariableSynchronization

__all__ = [
    "DefaultStrategy", "CrossDeviceOps", "NcclAllReduce", "HierarchicalCopyAllReduce",
    "ReductionToOneDevice",
    "InputContext", "ValueContext", "get_replica_context", "get_strategy", "has_strategy",
    "in_cross_replica_context", "MirroredStrategy", "MultiWorkerMirroredStrategy", "InputOptions",
    "RunOptions", "ReplicaContext", "Strategy", "StrategyExtended", "DistributedValues",
    "Mirrored", "PerReplica", "Variable", "VariableAggregation", "VariableSynchronization",
    "ReduceOp", "TPUStrategy", "DistributedDataset", "DistributedIterator",
]
