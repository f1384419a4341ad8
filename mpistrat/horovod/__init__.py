"""Horovod's API on mpistrat, for programs written for ``horovod.tensorflow.keras``.

Change the import and the program runs under ``mpirun``/``srun`` on mpistrat, with Keras 3 on
JAX (no Horovod, no TensorFlow)::

    import keras
    import mpistrat.horovod as hvd             # was: import horovod.tensorflow.keras as hvd

    hvd.init()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]    # each rank its own rows
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=4, verbose=1 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(),
                         hvd.callbacks.LearningRateWarmupCallback(1e-3 * hvd.size(),
                                                                  warmup_epochs=2)])

What it does, Horovod's contract kept: each rank trains on the rows it is given, in batches of
``batch_size`` of its own; every step averages the gradients over the ranks (weighted by rows,
which is Horovod's plain average when the ranks' batches are equal) before the optimizer
applies them, so the weights stay the same on every rank; metrics are summed over the ranks
(the logs are global and the same everywhere, so ``MetricAverageCallback`` leaves them as they
are). Where Horovod hangs (ranks with different numbers of batches, from arrays or from
generators) every rank raises a ``ValueError`` naming each rank's count.

``allreduce`` gives Horovod's numbers: ``op`` is ``Average`` (the default), ``Sum``, ``Min``,
``Max`` or ``Product`` (``average=`` the old way, never with ``op=``); ``prescale_factor``
multiplies the input before the reduction and ``postscale_factor`` the result after it (as
Horovod's TensorFlow op: the factors are float32; integers scaled in float64 and truncated
toward zero, float16 in float32); ``Average`` is the sum times ``postscale / size`` under
the same rule; ``compression=Compression.fp16`` sends floating tensors as float16 and returns
the input's dtype. The ranks agree on the op, the factors, the compression and the ``name``
(in the validation probe the engine sends anyway): a rank that differs makes every rank
raise, naming each rank's. ``broadcast_object`` and ``allgather_object`` agree the root and
the name given in the exchange that carries the objects. Not supported, and refused by name
(``NotSupportedError``, both a ``NotImplementedError`` and a ``ValueError``): ``op=Adasum``,
process sets other than the global one, ``hvd.elastic`` (mpistrat's elastic jobs requeue
and resume: ``slurm/train_elastic.sbatch``); ``DistributedOptimizer`` takes ``op=Average``
or ``Sum`` only (as Horovod's Keras one), and ``model.fit`` refuses it with
``backward_passes_per_step`` other than 1 (custom loops honour it).

``DistributedOptimizer`` reduces the gradients wherever the optimizer is handed them: in
``fit``, and in custom loops (``apply_gradients``, ``apply``, ``stateless_apply``), with
Horovod's ``op``, ``gradient_predivide_factor``, ``compression`` and
``backward_passes_per_step`` (``optimizer.py``). Nothing is broadcast at compile:
``BroadcastGlobalVariablesCallback`` gives every rank its root's model and optimizer after
the first batch, as Horovod's.

Beside them: ``shutdown``/``is_initialized`` (after ``shutdown()`` calls raise
``NotInitializedError`` until ``init()`` again; MPI stays up), ``mpi_threads_supported``
(MPI's thread level), ``mpi_enabled``/``mpi_built``/``gloo_enabled``/``gloo_built``/
``nccl_built``, ``join`` (an agreement that every rank has finished: see its text for how it
differs), ``load_model`` (Keras's, the optimizer wrapped in ``DistributedOptimizer``) and the
callbacks in ``hvd.callbacks``, learning-rate schedule and warm-up included.
"""

import importlib
from typing import Any

from mpistrat.horovod.collectives import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                          allgather_object, allreduce, broadcast,
                                          broadcast_object, broadcast_variables, join)
from mpistrat.horovod.compression import (Compression, Compressor,  # noqa: F401 - as before
                                          FP16Compressor, NoneCompressor)
from mpistrat.horovod.distributed_optimizer import DistributedOptimizer, load_model
from mpistrat.horovod.world import (NotInitializedError, NotSupportedError, ProcessSet,
                                    add_process_set, cross_rank, cross_size, gloo_built,
                                    gloo_enabled, global_process_set, init, is_initialized,
                                    local_rank, local_size, mpi_built, mpi_enabled,
                                    mpi_threads_supported, nccl_built, rank, remove_process_set,
                                    shutdown, size)

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_threads_supported", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "nccl_built", "join", "allreduce", "allgather",
           "broadcast", "broadcast_object", "allgather_object", "broadcast_variables",
           "DistributedOptimizer", "load_model", "Average", "Sum", "Min", "Max", "Adasum",
           "Product", "Compression", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "NotSupportedError", "NotInitializedError", "callbacks",
           "elastic"]


def __getattr__(name: str) -> Any:   # hvd.callbacks (with Keras) and hvd.elastic, when used
    if name in ("callbacks", "elastic"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mpistrat.horovod' has no attribute {name!r}")
