"""The train and test steps of a Keras 3 (JAX) model distributed by ``distribute_model``.

What one replica computes in a step and how the replicas' results are combined, in one
all-reduce per step (``ms.nn.all_reduce_gradients``)::

    train_step, test_step = make_steps(model, strategy, per_rank_data=False)

* Gradients, by the loss's rule (``checks.loss_rule``): ``"rows"`` (every loss a mean,
  Keras's default ``sum_over_batch_size``): each replica's gradient weighted by its rows and
  the sum divided by the global batch's rows, the gradient one process computes on the global
  batch; ``"replicas"`` (a loss with ``reduction="sum"``): TensorFlow's rule under a strategy
  of N replicas, each replica's losses scaled as Keras's TensorFlow backend scales them (a
  mean loss and the regularisation losses divided by N, a summed loss as it is) and the
  replicas' gradients summed; the loss logged is N times the replica's, weighted by its rows,
  as TensorFlow's train step logs it.
* Metric variables: each step's change summed over the replicas (global sums everywhere).
* Non-trainable state the step writes: floating values (BatchNormalization's moving mean and
  variance, its renorm statistics, any running statistic) are averaged over the replicas that
  had rows, every step, so they are bitwise the same on every rank at every callback,
  evaluation and checkpoint. The update is linear (``m' = m * momentum + b * (1 - momentum)``),
  so this mean equals the mean of the copies each replica would keep on its own (to float32
  rounding): the mean TensorFlow's ``ON_READ``/``MEAN`` variables read. State never written
  (a frozen layer's kernel) is left as it is. Other state (a seed generator's counter)
  advances alike everywhere: a replica without rows runs the passes on one row of zeros with
  sample weight 0, unless the model synchronises its batch statistics
  (``SyncBatchNormalization``), whose empty replicas run on their 0 rows. What that row
  computes is dropped: its gradient is TensorFlow's empty replica's, zero under ``"rows"``,
  and under ``"replicas"`` the gradient of its share of the weight regularisers alone (its
  data loss, activity regularisers and ``add_loss`` terms are those of no rows: 0), taken
  apart from the row, so a NaN the zero row makes reaches no rank.
  Floating means include ``bfloat16``, ``float16`` and the float8 types (a
  ``keras.config.set_dtype_policy("bfloat16")`` model's statistics): summed and divided in
  float32 and cast back, the same bits on every rank.
"""

from typing import Any

from mpistrat.keras.checks import _rows, loss_rule
from mpistrat.keras.context import reduced_here

__all__ = ["make_steps"]


def _horovod_reduction(optimizer: Any) -> Any:
    """The ``GradientReduction`` of an ``hvd.DistributedOptimizer`` (maybe inside Keras's
    ``LossScaleOptimizer``), else ``None``."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        reduction = getattr(candidate, "_mpistrat_hvd_reduction", None)
        if reduction is not None:
            return reduction
    return None


def _one_zero_row(x, y, sample_weight):
    """A batch of one row of zeros with sample weight 0, shaped like ``(x, y)``: what a
    replica without rows runs, so that its seed generators advance as the others' do."""
    import jax
    import jax.numpy as jnp

    def row(a):
        return jnp.zeros((1,) + tuple(a.shape[1:]), a.dtype)
    x, y = jax.tree_util.tree_map(row, (x, y))
    weight = jnp.zeros((1,), jnp.float32) if sample_weight is None else \
        jax.tree_util.tree_map(row, sample_weight)
    return x, y, weight


def _floating(dtype) -> bool:
    """Whether ``dtype`` is a floating type, ``ml_dtypes``' ``bfloat16`` and float8 types
    included (NumPy's ``issubdtype(..., np.floating)`` says no to those: kind ``'V'``)."""
    import jax.numpy as jnp
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _written(before, after) -> list:
    """Per non-trainable variable: whether the traced step assigned it (Keras hands back the
    very value it was given for a variable that nothing assigned)."""
    return [new is not old for old, new in zip(before, after)]


def make_steps(model: Any, strategy: Any, per_rank_data: bool, synchronized: bool):
    """``(train_step, test_step)`` for ``model``'s instance under ``strategy`` (see above)."""
    import jax
    import jax.numpy as jnp
    import keras
    from keras.utils import unpack_x_y_sample_weight
    from mpistrat.keras.adapter import (replica_losses, update_metrics,
                                        weight_regularisation_loss)
    from mpistrat.nn import all_reduce_gradients

    replicas = strategy.num_replicas_in_sync

    def reduce_sum(tree):
        return all_reduce_gradients(tree, strategy, "SUM")

    def metrics_logs(metrics_variables):
        with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables,
                                                         metrics_variables))):
            return model.get_metrics_result()

    def summed_deltas(old, new, present):
        return [jnp.where(present, n - o, jnp.zeros_like(o)) for o, n in zip(old, new)]

    def passes(rule, trainable, non_trainable, optimizer_vars, metrics_vars, x, y,
               sample_weight):
        """This replica's loss gradient, its non-trainable state after the forward pass,
        which of those the step wrote, and its metric variables after the batch."""
        written = []

        def loss(*args, **kwargs):
            value, aux = model.compute_loss_and_updates(*args, **kwargs)
            written[:] = _written(args[1], aux[2])
            return (value.sum() if getattr(value, "ndim", 0) else value), aux

        with replica_losses(model, replicas if rule == "replicas" else 1):
            (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(
                trainable, non_trainable, metrics_vars, x, y, sample_weight, training=True,
                optimizer_variables=optimizer_vars)
            unscaled, y_pred, non_trainable, after_loss = aux
            if rule == "replicas":   # (TensorFlow logs the replica's loss times N)
                unscaled = unscaled * jnp.asarray(replicas, unscaled.dtype)
            new_metrics = update_metrics(model, after_loss, unscaled, x, y, y_pred,
                                         sample_weight)
        return grads, non_trainable, written, new_metrics

    def regularisation_grads(trainable, optimizer_vars):
        """An empty replica's gradient under ``"replicas"`` (TensorFlow's): of its share of
        the weight regularisers alone, scaled as the optimizer scales a loss."""
        def loss(values):
            total = weight_regularisation_loss(model, values)
            scale = getattr(model.optimizer, "scale_loss", None)
            if scale is None:
                return total
            with keras.StatelessScope(state_mapping=list(zip(model.optimizer.variables,
                                                             optimizer_vars))):
                return scale(total)

        with replica_losses(model, replicas):
            return jax.grad(loss)(list(trainable))

    def train_step(state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        rule = loss_rule(model, per_rank_data, synchronized)
        rows = _rows(x)
        present = rows > 0   # (static: the batch's shape)
        given = (x, y, sample_weight) if present or synchronized else \
            _one_zero_row(x, y, sample_weight)   # (the same variables written everywhere)
        grads, after, written, new_metrics = passes(rule, trainable, non_trainable,
                                                    optimizer_vars, metrics_vars, *given)
        if not present and not synchronized and rule == "replicas":
            # (the zero row's gradient dropped: its activity regularisers and add_loss terms,
            # a NaN it makes, are no part of TensorFlow's empty replica's)
            grads = regularisation_grads(trainable, optimizer_vars)
        weight = jnp.asarray(rows if rule == "rows" else 1, jnp.float32)
        # hvd.DistributedOptimizer with op=Sum, compression or a predivide factor: each
        # rank's own mean gradient reduced by Horovod's rules; else combined below
        horovod = _horovod_reduction(model.optimizer) if per_rank_data else None
        horovod = horovod.for_fit() if horovod is not None else None
        keep = present or rule == "replicas"   # (an empty replica's share: TensorFlow's)
        if horovod is not None:
            local = jax.tree_util.tree_map(
                lambda g: jnp.where(present, g, jnp.zeros_like(g)), grads)
            weighted = []
        else:
            weighted = jax.tree_util.tree_map(
                lambda g: jnp.where(keep, g * weight.astype(g.dtype), jnp.zeros_like(g)),
                grads)
        deltas = summed_deltas(metrics_vars, new_metrics, present)
        averaged = [w and _floating(v.dtype) for w, v in zip(written, non_trainable)]
        wide = [jnp.promote_types(v.dtype, jnp.float32) for v in non_trainable]
        floats = [jnp.where(present, v.astype(t), jnp.zeros(v.shape, t)) if a else None
                  for v, a, t in zip(after, averaged, wide)]   # (bfloat16, float8: in float32)
        weighted, total, deltas, floats, holders = reduce_sum(
            (weighted, weight, deltas, floats, jnp.asarray(float(present), jnp.float32)))
        non_trainable = [v if f is None else jnp.where(
            holders > 0, (f / jnp.maximum(holders, 1.0).astype(f.dtype)).astype(old.dtype),
            old) for v, f, old in zip(after, floats, non_trainable)]
        if horovod is not None:
            grads = horovod(list(local))
        elif rule == "rows":
            grads = jax.tree_util.tree_map(
                lambda g: g / jnp.maximum(total, 1.0).astype(g.dtype), weighted)
        else:
            grads = weighted
        with reduced_here():   # (reduced above: a DistributedOptimizer applies them as they are)
            trainable, optimizer_vars = model.optimizer.stateless_apply(optimizer_vars, grads,
                                                                        trainable)
        metrics_vars = [o + d for o, d in zip(metrics_vars, deltas)]
        return metrics_logs(metrics_vars), (trainable, non_trainable, optimizer_vars,
                                            metrics_vars)

    def test_step(state, data):
        trainable, non_trainable, metrics_vars = state
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        rule = loss_rule(model, per_rank_data, synchronized)
        rows = _rows(x)
        new_metrics = metrics_vars
        if rows > 0:
            with replica_losses(model, replicas if rule == "replicas" else 1):
                _, aux = model.compute_loss_and_updates(trainable, non_trainable,
                                                        metrics_vars, x, y, sample_weight,
                                                        training=False)
                unscaled, y_pred, non_trainable, after_loss = aux
                if rule == "replicas":
                    unscaled = unscaled * jnp.asarray(replicas, unscaled.dtype)
                new_metrics = update_metrics(model, after_loss, unscaled, x, y, y_pred,
                                             sample_weight)
        deltas = reduce_sum(summed_deltas(metrics_vars, new_metrics, rows > 0))
        metrics_vars = [o + d for o, d in zip(metrics_vars, deltas)]
        return metrics_logs(metrics_vars), (trainable, non_trainable, metrics_vars)

    return train_step, test_step
