"""mpistrat: the ``tf.distribute`` Strategy API and ``tf.train.Checkpoint`` over MPI.

One replica per MPI rank; launch with ``mpirun -n N python train.py``::

    import mpistrat as ms

    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        w = ms.Variable(0.0, aggregation=ms.VariableAggregation.MEAN)

    def step(x):
        w.assign_add(x)               # averaged over replicas
        return x

    out = strategy.run(step, args=(1.0,))
    print(strategy.reduce("SUM", out, axis=None))   # N
"""

import sys as _sys
if _sys.argv[:2] == ["-m", "doctor"]:   # python -m mpistrat doctor: h5py's MPI is read from
    from mpistrat.runtime.libraries import foreign_h5py, refuse_doctor   # its libraries first
    if foreign_h5py():                  # (importing one built for another MPI crashes)
        refuse_doctor(foreign_h5py())
from mpistrat import errors, nest
from mpistrat.runtime import install_abort_hook as _install_abort_hook
from mpistrat.runtime.jax_threads import widen_cpu_pool as _widen_cpu_pool

_install_abort_hook()
_widen_cpu_pool()   # JAX's CPU pool on a rank bound to one core: two threads (before JAX starts)

from mpistrat import cluster_resolver, config  # noqa: E402
from mpistrat.collectives import (CommunicationImplementation, CommunicationOptions,  # noqa: E402
                                  ReduceOp)
from mpistrat.distribute import (DistributedValues, InputContext, InputOptions,  # noqa: E402
                                 Mirrored, MirroredStrategy, MultiWorkerMirroredStrategy,
                                 PerReplica, ReplicaContext, RunOptions, Strategy, ValueContext,
                                 Variable, VariableAggregation, VariableSynchronization,
                                 get_replica_context, get_strategy, has_strategy,
                                 in_cross_replica_context)
from mpistrat.distribute.tpu import TPUStrategy  # noqa: E402
from mpistrat import experimental, tpu  # noqa: E402
from mpistrat.checkpoint import (Checkpoint, CheckpointManager, CheckpointOptions,  # noqa: E402
                                 CheckpointManagerOptions, latest_checkpoint)
from mpistrat import train  # noqa: E402
from mpistrat import nn  # noqa: E402
from mpistrat import preemption  # noqa: E402  (adds ms.distribute.experimental's handler)
# model.fit under a scope (Keras optional: the hooks install once Keras is imported)
from mpistrat import keras  # noqa: E402,F401  (ms.keras: Keras itself is not imported)
from mpistrat.keras import hooks as _keras_hooks  # noqa: E402,F401  (its scope hook)
from mpistrat import distribute  # noqa: E402
from mpistrat import data  # noqa: E402
from mpistrat import io  # noqa: E402
from mpistrat import summary  # noqa: E402  (TensorBoard event files without TensorFlow)
from mpistrat import horovod  # noqa: E402,F401  (ms.horovod, as `import mpistrat.horovod as hvd`)

__version__ = "0.1.0"

__all__ = [
    "errors", "nest", "cluster_resolver", "config", "experimental",
    "CommunicationImplementation", "CommunicationOptions", "ReduceOp",
    "DistributedValues", "InputContext", "InputOptions", "Mirrored", "MirroredStrategy",
    "MultiWorkerMirroredStrategy", "TPUStrategy", "tpu", "PerReplica", "ReplicaContext", "RunOptions", "Strategy",
    "ValueContext", "Variable", "VariableAggregation", "VariableSynchronization",
    "get_replica_context", "get_strategy", "has_strategy", "in_cross_replica_context",
    "Checkpoint", "CheckpointManager", "CheckpointManagerOptions", "CheckpointOptions",
    "latest_checkpoint", "train", "data",
    "distribute", "preemption", "io", "nn",
]
