"""``ms.nn``: loss scaling for distributed training, and gradient aggregation for optax.

TensorFlow's rules for a custom training loop: each replica averages its
per-example losses over the **global** batch (``compute_average_loss``), so
that summing the replicas' gradients gives the gradient of the global mean;
regularisation losses are divided by the number of replicas
(``scale_regularization_loss``). TensorFlow's optimizers then sum the
gradients across replicas inside ``apply_gradients``; JAX's optimizers
(optax) do not, so a port adds ``aggregate_gradients`` to its chain::

    >>> import numpy as np, mpistrat as ms
    >>> float(ms.nn.compute_average_loss(np.array([1.0, 2.0, 3.0]), global_batch_size=6))
    1.0
    >>> float(ms.nn.compute_average_loss(np.array([1.0, 2.0]), sample_weight=np.array([1.0, 0.0])))
    0.5
    >>> float(ms.nn.scale_regularization_loss(np.array([0.5, 1.5])))   # one replica: the sum
    2.0

    # optax: the gradients are averaged over all replicas inside the update
    # tx = optax.chain(ms.nn.aggregate_gradients(strategy), optax.adam(1e-3))

Inputs may be NumPy, CuPy or JAX arrays (JAX tracers too, inside
``jax.grad`` or ``jax.jit``); results are of the same kind and dtype.
"""

import functools
from typing import Any, Optional

import numpy as np

from mpistrat.collectives import ReduceOp, host_callbacks
from mpistrat.distribute.context import get_strategy, has_strategy, in_cross_replica_context
from mpistrat.errors import InvalidArgumentError
from mpistrat.runtime.devices import array_kind

__all__ = ["compute_average_loss", "scale_regularization_loss", "aggregate_gradients",
           "all_reduce_gradients"]


def _xp(value: Any):
    """The array module of ``value`` (JAX for JAX arrays and tracers)."""
    kind = array_kind(value)
    if kind == "jax" or (kind == "numpy" and type(value).__module__.startswith("jax")):
        import jax.numpy as jnp
        return jnp
    if kind == "cupy":
        import cupy
        return cupy
    return np


def _result(xp, value):
    """NumPy results as NumPy scalars of their dtype (as TensorFlow returns 0-d tensors)."""
    return value[()] if xp is np and isinstance(value, np.ndarray) else value


def _scale_by_weight(xp, losses, weight):
    """``losses * weight`` with TensorFlow's alignment: a weight of lower rank is
    broadcast from the left (one weight per example), a trailing size-1 axis dropped."""
    weight = xp.asarray(weight).astype(losses.dtype)
    if weight.ndim == losses.ndim + 1 and weight.shape[-1] == 1:
        weight = weight.reshape(weight.shape[:-1])
    elif losses.ndim == weight.ndim + 1 and losses.shape[-1] == 1:
        losses = losses.reshape(losses.shape[:-1])
    if weight.ndim < losses.ndim:
        weight = weight.reshape(weight.shape + (1,) * (losses.ndim - weight.ndim))
    try:
        return losses * xp.broadcast_to(weight, losses.shape)
    except ValueError:
        raise InvalidArgumentError(
            f"compute_average_loss: sample_weight of shape {tuple(weight.shape)} does not "
            f"broadcast to per_example_loss of shape {tuple(losses.shape)}") from None


def _batch_size(global_batch_size: Any) -> int:
    """``global_batch_size`` as a positive int, or ``InvalidArgumentError``."""
    value = np.asarray(global_batch_size)
    if value.ndim != 0:
        raise InvalidArgumentError(f"global_batch_size must be scalar, got shape {value.shape}")
    if value.dtype.kind not in "iu":
        raise InvalidArgumentError(f"global_batch_size must be an integer, got "
                                   f"{global_batch_size!r} ({value.dtype})")
    if int(value) <= 0:
        raise InvalidArgumentError(f"global_batch_size must be positive, got {int(value)}")
    return int(value)


def _replica_context_only(what: str) -> None:
    if has_strategy() and in_cross_replica_context():
        raise RuntimeError(f"You are calling `{what}` in cross replica context, while it was "
                           f"expected to be called in replica context (inside strategy.run)")


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None,
                         global_batch_size: Optional[int] = None):
    """The sum of (weighted) per-example losses divided by the global batch size.

    ``global_batch_size`` defaults to the first dimension of
    ``per_example_loss`` times ``num_replicas_in_sync`` of the current
    strategy (then it must be called in replica context: ``RuntimeError``
    otherwise). Pass it explicitly when the last batch is short, as the
    division must be by the rows of the whole global batch. Summing the
    result over replicas gives the global mean::

        >>> import numpy as np, mpistrat as ms
        >>> float(ms.nn.compute_average_loss(np.ones((4, 2)), global_batch_size=8))
        1.0
    """
    xp = _xp(per_example_loss)
    losses = xp.asarray(per_example_loss)
    if losses.ndim == 0:
        raise ValueError("Invalid value passed for `per_example_loss`: expected an array of "
                         "rank >= 1 (one loss per example), got a scalar")
    dtype = losses.dtype
    if sample_weight is not None:
        losses = _scale_by_weight(xp, losses, sample_weight).astype(dtype)
    if global_batch_size is None:
        _replica_context_only("compute_average_loss")
        global_batch_size = losses.shape[0] * get_strategy().num_replicas_in_sync
        if global_batch_size == 0:  # an empty batch on every replica: nothing to average
            return _result(xp, xp.sum(losses))
    size = _batch_size(global_batch_size)
    total = xp.sum(losses)
    if np.dtype(dtype).kind in "fc":
        return _result(xp, total / xp.asarray(size, dtype=dtype))
    return _result(xp, total / size)


def scale_regularization_loss(regularization_loss: Any):
    """The sum of ``regularization_loss`` divided by ``num_replicas_in_sync``.

    Regularisation terms are computed on every replica with the same
    variables; dividing by the replica count makes their summed gradient
    count once. Call in replica context (``RuntimeError`` in cross-replica
    context)::

        >>> import numpy as np, mpistrat as ms
        >>> float(ms.nn.scale_regularization_loss([0.25, 0.75]))
        1.0
    """
    _replica_context_only("scale_regularization_loss")
    xp = _xp(regularization_loss)
    loss = xp.asarray(regularization_loss)
    total = xp.sum(loss)
    replicas = get_strategy().num_replicas_in_sync
    if np.dtype(loss.dtype).kind in "fc":
        return _result(xp, total / xp.asarray(replicas, dtype=loss.dtype))
    return _result(xp, total / replicas)



# -- gradient aggregation for optax ------------------------------------------------------------
class _Aggregation:
    """The collective of ``aggregate_gradients``: eager, or through a host callback when traced.

    Traced, the callback runs once per call of the jitted function (its values gathered to
    one device), or inside ``shard_map``/``pmap`` once per device: then the devices' calls
    are joined into one collective (``host_callbacks.gathered``), device ``i``'s values
    reduced with device ``i``'s of every other rank."""

    def __init__(self, strategy, reduce_op, options):
        self.engine = strategy.extended.engine
        self.op = reduce_op
        self.options = options

    def host(self, *leaves):
        """All-reduce host copies of the leaves; results in the leaves' own dtypes."""
        arrays = [np.asarray(leaf) for leaf in leaves]
        with host_callbacks.running():
            out = self.engine.all_reduce(arrays, self.op, self.options)
        return tuple(np.asarray(r, dtype=a.dtype).reshape(a.shape) for r, a in zip(out, arrays))

    def each_device(self, count: int, site, position, *leaves):
        """Device ``position``'s part of one all-reduce of all ``count`` devices' leaves, met
        only with the calls of the same traced callback (``site``)."""
        timeout = self.engine.options.merge(self.options).timeout_seconds

        def reduce_flat(flat):   # (ranks with other device counts differ by name)
            out = self.engine.all_reduce(flat, self.op, self.options,
                                         label=f"ms.nn, {count} devices per rank")
            return [np.asarray(r, dtype=a.dtype).reshape(a.shape) for r, a in zip(out, flat)]

        return tuple(host_callbacks.gathered_flat(count, int(position),
                                                  [np.asarray(leaf) for leaf in leaves],
                                                  reduce_flat, timeout, site))

    def traced(self, leaves, what: str):
        """The reduced leaves, through an ordered host callback of the traced program."""
        import jax
        from jax.experimental import io_callback
        axes = host_callbacks.per_device_axes(what)
        host_callbacks.traced()   # the program's own collectives now wait for these
        shapes = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves)
        try:
            if not axes:
                return io_callback(self.host, shapes, *leaves, ordered=True)
            count = int(np.prod([jax.sharding.get_abstract_mesh().shape[a] for a in axes]))
            site = host_callbacks.site(f"ms.nn.{what}{host_callbacks.traced_at()}")   # this traced call
            return io_callback(functools.partial(self.each_device, count, site), shapes,
                               jax.lax.axis_index(axes), *leaves, ordered=True)
        except ValueError as err:
            if "vmap" not in str(err):
                raise
            raise InvalidArgumentError(
                f"{what} inside jax.vmap: its collective runs once per call, not per mapped "
                f"element; call it outside the vmap, on the stacked values (the all-reduce is "
                f"element-wise, so the numbers are the same)") from err

    def __call__(self, updates, what: str = "all_reduce_gradients"):
        import jax
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if not leaves:
            return updates
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):  # inside jit or grad
            reduced = self.traced(leaves, what)
        else:
            reduced = [jax.numpy.asarray(r) if array_kind(x) == "jax" else r
                       for r, x in zip(self.host(*leaves), leaves)]
        return jax.tree_util.tree_unflatten(treedef, list(reduced))


def _checked(strategy, reduce_op, what: str):
    """The strategy and op to aggregate with, or ``ValueError`` saying what to pass."""
    from mpistrat.runtime import get_world
    strategy = strategy if strategy is not None else get_strategy()
    if not has_strategy() and strategy is get_strategy() and get_world().size > 1:
        raise ValueError(f"{what}: no strategy given and none is current, but this "
                         f"job runs {get_world().size} ranks; pass the strategy "
                         f"({what}(strategy)) or call it inside strategy.scope()")
    if getattr(strategy.extended, "replicas_in_compiled_steps", False):
        raise ValueError(f"{what}: {type(strategy).__name__} runs its replicas "
                         f"inside compiled steps; aggregate with "
                         f"ms.get_replica_context().all_reduce inside strategy.run")
    op = ReduceOp.from_any(reduce_op)
    if op not in (ReduceOp.SUM, ReduceOp.MEAN):
        raise ValueError(f"{what}: reduce_op must be SUM or MEAN, got {op.name}")
    return strategy, op


def all_reduce_gradients(grads: Any, strategy=None, reduce_op="MEAN", options=None):
    """``grads`` (any JAX pytree) combined over all replicas; usable inside ``jax.jit``.

    For loops that call an optimizer themselves (Keras 3's
    ``optimizer.stateless_apply``, Flax NNX's ``optimizer.update``)::

        grads = ms.nn.all_reduce_gradients(grads, strategy, "SUM")   # inside the jitted step

    ``reduce_op``, ``options`` and ``strategy`` as for ``aggregate_gradients``.
    Inside ``jax.jit`` the whole gradient is reduced once per call, however its
    arrays are sharded over this process's devices. Inside ``shard_map`` (every
    mesh axis manual) or ``pmap`` each device's gradients are reduced with the
    same device's of every other rank, in one collective per call::

        def body(params, batch):   # shard_map(body, mesh=mesh, in_specs=(P(), P("d")), ...)
            # JAX already sums the gradient of parameters replicated over "d" (P()) across
            # "d": divide each device's mean loss by the axis size for the mean over devices
            loss = lambda p: loss_fn(p, batch) / jax.lax.axis_size("d")
            return ms.nn.all_reduce_gradients(jax.grad(loss)(params), strategy)

    Inside ``jax.vmap``, or a ``shard_map`` leaving mesh axes automatic, it raises
    ``InvalidArgumentError`` (a ``ValueError``) saying where to call it instead.
    """
    strategy, op = _checked(strategy, reduce_op, "all_reduce_gradients")
    return _Aggregation(strategy, op, options)(grads)


def aggregate_gradients(strategy=None, reduce_op="MEAN", options=None):
    """An optax ``GradientTransformation`` that all-reduces the updates it is given.

    Put it first in the chain, so that every replica's optimizer sees the
    same aggregated gradients and the replicas' parameters stay identical
    (TensorFlow's optimizers do the same inside ``apply_gradients``)::

        tx = optax.chain(ms.nn.aggregate_gradients(strategy), optax.adam(1e-3))
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            grads = jax.grad(loss_fn)(params, batch)      # this replica's batch
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

    ``reduce_op``: ``"MEAN"`` (the default) for losses averaged over the
    replica's own batch; ``"SUM"`` for losses scaled by
    ``compute_average_loss`` (divided by the global batch). ``options``: a
    ``CommunicationOptions`` (``deterministic=True`` for bitwise
    reproducible sums). Works eagerly and under ``jax.jit`` (the collective
    runs in an ordered host callback, so every rank must run the same steps).
    ``strategy``: defaults to the current one; outside every scope of a job
    of several ranks that is a ``ValueError``, never a silent no-op. Under
    ``TPUStrategy`` use ``ms.get_replica_context().all_reduce`` inside
    ``strategy.run`` instead (the replicas there are the devices).
    """
    import optax
    strategy, op = _checked(strategy, reduce_op, "aggregate_gradients")
    aggregate = _Aggregation(strategy, op, options)

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        return aggregate(updates, "aggregate_gradients"), state

    return optax.GradientTransformation(init, update)
