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
are). Where Horovod hangs (ranks with different numbers of batches) every rank raises a
``ValueError`` naming each rank's count. Not supported, and refused by name: ``Adasum``,
``Product``, gradient compression other than none, ``backward_passes_per_step`` other than 1.
"""

import importlib
from typing import Any

import numpy as np

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_enabled", "mpi_built", "allreduce", "allgather",
           "broadcast", "broadcast_object", "allgather_object", "broadcast_variables",
           "DistributedOptimizer", "Average", "Sum", "Min", "Max", "Adasum", "Product",
           "Compression", "callbacks"]

Average, Sum, Min, Max, Adasum, Product = "Average", "Sum", "Min", "Max", "Adasum", "Product"
_REDUCE = {Average: "MEAN", Sum: "SUM", Min: "MIN", Max: "MAX"}


class Compression:
    """Horovod's gradient compression: only ``Compression.none`` (gradients travel as they are)."""
    none = "none"
    fp16 = "fp16"


_STATE: dict = {}


def init(comm: Any = None) -> None:
    """Start (collective): the world and a ``MultiWorkerMirroredStrategy`` over every rank.
    ``comm`` other than the whole world is not supported."""
    if comm is not None:
        raise ValueError("hvd.init(comm=...): mpistrat.horovod runs over every rank of the job")
    if "strategy" not in _STATE:
        from mpistrat.distribute.mirrored import MultiWorkerMirroredStrategy
        _STATE["strategy"] = MultiWorkerMirroredStrategy()


def shutdown() -> None:
    """Forget the strategy (MPI itself ends with the process)."""
    _STATE.clear()


def is_initialized() -> bool:
    return "strategy" in _STATE


def _strategy():
    if "strategy" not in _STATE:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _STATE["strategy"]


def _world():
    _strategy()
    from mpistrat.runtime import get_world
    return get_world()


def rank() -> int:
    """This process's rank among all (``hvd.rank()``)."""
    return _world().rank


def size() -> int:
    """The number of ranks (``hvd.size()``)."""
    return _world().size


def local_rank() -> int:
    """This rank's index on its node: pick a GPU with it."""
    return _world().local_rank


def local_size() -> int:
    """The number of ranks on this rank's node."""
    return _world().local_size


def cross_rank() -> int:
    """The index of this rank's node."""
    return _world().node_index


def cross_size() -> int:
    """The number of nodes."""
    return _world().num_nodes


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def _engine():
    return _strategy().extended.engine


def _op(op: Any, average: Any) -> str:
    if average is not None:
        op = Average if average else Sum
    op = Average if op is None else op
    if op not in _REDUCE:
        raise ValueError(f"mpistrat.horovod: op={op!r} is not supported (Average, Sum, Min, "
                         f"Max are)")
    return _REDUCE[op]


def allreduce(tensor: Any, average: Any = None, name: str = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """The reduction of ``tensor`` over the ranks (default: the average), on every rank."""
    value = np.asarray(tensor)
    if prescale_factor != 1.0:
        value = value * prescale_factor
    out = _engine().all_reduce(value, _op(op, average))
    return out * postscale_factor if postscale_factor != 1.0 else out


def allgather(tensor: Any, name: str = None) -> Any:
    """Every rank's ``tensor`` concatenated along the first axis, in rank order (first
    dimensions may differ between ranks)."""
    return _engine().all_gather(np.asarray(tensor), 0)


def broadcast(tensor: Any, root_rank: int, name: str = None) -> Any:
    """Rank ``root_rank``'s ``tensor`` on every rank."""
    return _engine().broadcast(np.asarray(tensor), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str = None) -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank."""
    return _engine().broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: str = None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    return _world().comm.allgather(obj)


def broadcast_variables(variables: Any, root_rank: int) -> None:
    """Assign rank ``root_rank``'s values to ``variables`` (Keras variables) on every rank."""
    variables = list(variables)
    values = _engine().broadcast([np.asarray(v.value if hasattr(v, "value") else v)
                                  for v in variables], root_rank)
    for variable, value in zip(variables, values):
        variable.assign(value)


def DistributedOptimizer(optimizer: Any, name: str = None, compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: Any = Average, **kwargs: Any) -> Any:  # noqa: N802 - Horovod's name
    """``optimizer`` (a Keras 3 optimizer), marked so that ``model.compile(optimizer=...)``
    makes the model average each step's gradients over the ranks, each rank training on
    its own rows; returns the same optimizer object. Given an optax
    ``GradientTransformation``, returns ``optax.chain(ms.nn.aggregate_gradients(...), tx)``:
    the gradients averaged over the ranks (inside ``jax.jit`` too) before ``tx`` sees them::

        tx = hvd.DistributedOptimizer(optax.adam(1e-3))
        opt_state = tx.init(params)       # then tx.update(grads, opt_state, params) per step
    """
    if compression not in (None, Compression.none):
        raise ValueError(f"hvd.DistributedOptimizer: compression={compression!r} is not "
                         f"supported; gradients travel uncompressed (Compression.none)")
    if backward_passes_per_step != 1:
        raise ValueError("hvd.DistributedOptimizer: backward_passes_per_step must be 1 here")
    if op != Average:
        raise ValueError(f"hvd.DistributedOptimizer: op={op!r} is not supported; gradients "
                         f"are averaged over the ranks (op=hvd.Average)")
    _strategy()
    if not hasattr(optimizer, "apply_gradients") and hasattr(optimizer, "update") and \
            hasattr(optimizer, "init"):                       # an optax transformation
        import optax
        from mpistrat.nn import aggregate_gradients
        return optax.chain(aggregate_gradients(_strategy(), "MEAN"), optimizer)
    from mpistrat import keras_hooks
    keras_hooks.install()
    optimizer._mpistrat_horovod = _strategy()
    return optimizer


def __getattr__(name: str) -> Any:   # hvd.callbacks, imported with Keras when first used
    if name == "callbacks":
        return importlib.import_module(".callbacks", __name__)
    raise AttributeError(f"module 'mpistrat.horovod' has no attribute {name!r}")
