"""``SyncBatchNormalization``: Keras 3 batch normalization over the global batch.

Keras 3 refuses ``BatchNormalization(synchronized=True)`` outside TensorFlow ("only supported
with the TensorFlow backend"); under a strategy each replica would normalise with its own
rows' statistics. ``ms.keras.SyncBatchNormalization`` (the same arguments) computes, in
training, the mean and variance of the whole global batch, as TensorFlow's synchronized
layer does, in two passes (two all-reduces per layer and step, in the ordered host callback
of ``ms.nn``; a replica without rows joins both): each replica's sums and count are summed
over the ranks (``C + 1`` numbers), ``mean = sum / count``; then each replica's sum of
squared deviations from that global mean (``C`` numbers), ``variance = total / count``.
Unlike ``E[x^2] - mean^2``, which cancels to nothing for features far from 0 (mean 5000, std
1: ``x^2`` is ~2.5e7 and float32 keeps it to ~2, so the variance came out as rounding noise,
0 to a few units, and a 0 divided by ``sqrt(epsilon)``), this is exact to float32 rounding at
any offset, as Keras's own ``jnp.var`` is. The backward pass sums the replicas' gradients of
those totals (weighted by their rows, as ``fit`` weights the replicas' gradients), so the
update is the one a single process would compute on the global batch. Inference uses the
moving statistics, as always::

    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  ms.keras.SyncBatchNormalization(),  # was
                                  keras.layers.Dense(1)])  # BatchNormalization(synchronized=True)

Made inside a strategy's scope of several replicas it synchronises over that strategy;
otherwise (one replica, no scope) it is the plain layer. A masked call normalises per replica.
"""

import functools
import weakref

__all__ = ["sync_batch_normalization_class", "synchronizes", "bind"]

_STRATEGY_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def synchronizes(model) -> bool:
    """Whether ``model`` holds a synchronising layer (at any depth): then every replica,
    one without rows too, runs the forward and backward passes to join its all-reduces."""
    todo = list(getattr(model, "layers", []))
    while todo:
        layer = todo.pop()
        if layer in _STRATEGY_OF:
            return True
        todo.extend(getattr(layer, "layers", []))
    return False


def bind(model, strategy) -> None:
    """Let the synchronising layers of ``model`` that were made outside a scope (a model
    built before the strategy, or under ``hvd.init()`` with no scope) sum over
    ``strategy``'s replicas: done when the model is distributed (compiled in the scope, or
    with ``hvd.DistributedOptimizer``)."""
    if strategy is None or strategy.num_replicas_in_sync <= 1:
        return
    todo = list(getattr(model, "layers", []))
    while todo:
        layer = todo.pop()
        if getattr(layer, "_mpistrat_synchronized", False) and layer not in _STRATEGY_OF:
            _STRATEGY_OF[layer] = strategy
        todo.extend(getattr(layer, "layers", []))


def _refuse_unbound(layer) -> None:
    """A synchronising layer that trains in a job of several ranks without a strategy to
    sum over would normalise with its own replica's rows only: refused by name."""
    from mpi4py import MPI
    if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
        raise ValueError(
            f"SyncBatchNormalization {layer.name!r} trains in a job of "
            f"{MPI.COMM_WORLD.Get_size()} ranks but was made outside strategy.scope() and its "
            f"model was never distributed: it would normalise with this replica's rows only. "
            f"Make the model inside `with strategy.scope():`, or compile it there (or with "
            f"hvd.DistributedOptimizer); SyncBatchNormalization(synchronized=False) "
            f"normalises per replica on purpose")


@functools.lru_cache(maxsize=None)
def _global_sum(strategy):
    """``x`` summed over the replicas, differentiable: the backward pass sums the replicas'
    cotangents weighted by their rows (``rows``), as ``fit`` weights their gradients."""
    import jax
    import jax.numpy as jnp
    from mpistrat.nn import all_reduce_gradients

    @jax.custom_vjp
    def total(x, rows):
        return all_reduce_gradients(x, strategy, "SUM")

    def forward(x, rows):
        return total(x, rows), rows

    def backward(rows, cotangent):
        summed = all_reduce_gradients(cotangent * rows.astype(cotangent.dtype), strategy, "SUM")
        return summed / jnp.maximum(rows, 1).astype(cotangent.dtype), jnp.zeros_like(rows)

    total.defvjp(forward, backward)
    return total


@functools.lru_cache(maxsize=None)
def sync_batch_normalization_class():
    """The layer class (built at first use: Keras is a lazy dependency)."""
    import keras
    from keras import ops

    @keras.saving.register_keras_serializable(package="mpistrat")
    class SyncBatchNormalization(keras.layers.BatchNormalization):
        """``BatchNormalization`` whose training statistics are the global batch's."""

        def __init__(self, *args, synchronized: bool = True, **kwargs):
            super().__init__(*args, synchronized=False, **kwargs)
            self._mpistrat_synchronized = bool(synchronized)
            from mpistrat.distribute.context import get_strategy, has_strategy
            strategy = get_strategy() if has_strategy() else None
            if synchronized and strategy is not None and strategy.num_replicas_in_sync > 1:
                _STRATEGY_OF[self] = strategy

        def _moments(self, inputs, mask):
            strategy = _STRATEGY_OF.get(self)
            if strategy is None and self._mpistrat_synchronized:
                _refuse_unbound(self)
            if strategy is None or mask is not None:
                return super()._moments(inputs, mask)
            import jax.numpy as jnp
            axes = tuple(self._reduction_axes)
            count = 1
            for axis in axes:
                count *= inputs.shape[axis]
            rows = jnp.asarray(inputs.shape[0], jnp.float32)
            total = _global_sum(strategy)
            sums = total(ops.concatenate([ops.sum(inputs, axis=axes),
                                          jnp.full((1,), count, inputs.dtype)]), rows)
            number = sums[-1]
            mean = sums[:-1] / number
            # Second pass: squared deviations from the global mean, never E[x^2] - mean^2
            # (which cancels catastrophically when |mean| >> std).
            shape = [1 if i in axes else inputs.shape[i] for i in range(len(inputs.shape))]
            deviations = ops.square(inputs - ops.reshape(mean, shape))
            variance = ops.maximum(total(ops.sum(deviations, axis=axes), rows) / number,
                                   0.0)   # (a sum of squares: >= 0 already; kept as in TF)
            return mean, variance

        def get_config(self):
            config = super().get_config()   # (a clone or a loaded model synchronises too)
            config["synchronized"] = self._mpistrat_synchronized
            return config

    return SyncBatchNormalization

