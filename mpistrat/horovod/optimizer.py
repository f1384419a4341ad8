"""``hvd.DistributedOptimizer``'s reduction of the gradients, by Horovod 0.28's rules.

A Keras 3 optimizer given to ``hvd.DistributedOptimizer`` reduces the gradients it is handed
over the ranks before it applies them, wherever it is handed them:

* ``model.fit`` of a model compiled with it: the distributed train step reduces them
  (``keras.trainer.distribute_model``) and applies the result as it is (``reduced_here``);
* a custom loop, ``optimizer.apply_gradients(zip(grads, variables))`` or
  ``optimizer.apply(grads, variables)`` (eager): reduced here, on the host;
* ``optimizer.stateless_apply(...)`` in a loop of one's own (inside ``jax.jit`` too): reduced
  in an ordered host callback, as ``ms.nn.all_reduce_gradients``.

The reduction is Horovod's: ``op=Average`` (the default) is the sum over the ranks times
``1 / size`` (with ``gradient_predivide_factor`` ``f``: the input times ``1 / f`` before the
sum, the sum times ``f / size`` after it), ``op=Sum`` the plain sum; ``compression`` is applied
on the wire (``Compression.fp16``: floating gradients travel and are summed as float16, and
come back in their own dtype). With ``backward_passes_per_step=N`` the gradients of N calls
are summed on this rank, nothing is sent and the weights stay as they are (only the
optimizer's ``iterations`` counts the call); the N-th call reduces the local sum (divided by
N first with ``average_aggregated_gradients=True``) and applies it, as Horovod's
``LocalGradientAggregationHelperEager`` does::

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    for x, y in my_batches:                        # each rank its own
        grads = grad_fn(model.trainable_variables, x, y)
        opt.apply_gradients(zip(grads, model.trainable_variables))   # applied every 2nd call

Given an optax ``GradientTransformation`` it returns one that reduces the updates the same
way (inside ``jax.jit`` too), accumulating N passes first when asked, before the given one.
"""

import functools
import types
from typing import Any, List, Optional

import numpy as np

from mpistrat.keras.context import reduced_already, reduced_here

__all__ = ["GradientReduction", "distribute", "optax_transformation"]

def _traced(leaves) -> bool:
    import jax
    return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


class GradientReduction:
    """What one ``DistributedOptimizer`` does with the gradients: op, factors, compression,
    and the local accumulation of ``backward_passes_per_step`` (its state lives here)."""

    def __init__(self, strategy: Any, op: str, compression: Any, predivide: float,
                 passes: int, average_aggregated: bool, name: Optional[str]):
        from mpistrat.horovod.collectives import Average
        self.strategy, self.op, self.compression = strategy, op, compression
        self.passes, self.average_aggregated = passes, average_aggregated
        self.name = name
        # Horovod splits its average over the factors: 1/f before the sum, f/size after it
        self.prescale = 1.0 / predivide if op == Average else 1.0
        self.postscale = predivide if op == Average else 1.0
        self.predivide = predivide
        self.counter = 0                 # calls since the last reduction (passes > 1)
        self.aggregated: dict = {}       # gradient index -> this rank's running sum

    # -- what the ranks agree on ----------------------------------------------------------
    def label(self) -> str:
        from mpistrat.horovod.collectives import _described
        from mpistrat.horovod.compression import Compression, _compression_name
        return _described(f"hvd.DistributedOptimizer op={self.op}", name=self.name,
                          gradient_predivide_factor=self.predivide if self.predivide != 1.0
                          else None,
                          compression=None if self.compression is Compression.none else
                          _compression_name(self.compression))

    def is_plain(self) -> bool:
        """Horovod's default (``Average``, no compression, no predivide factor, one pass)."""
        from mpistrat.horovod.collectives import Average
        from mpistrat.horovod.compression import Compression
        return self.op == Average and self.compression is Compression.none and \
            self.predivide == 1.0 and self.passes == 1

    def take_outer(self, optimizer: Any) -> None:
        """``optimizer`` holds this reduction's ``DistributedOptimizer`` (Keras's
        ``LossScaleOptimizer`` under ``mixed_float16``): it reduces at its own entry, so every
        rank checks the same reduced gradients for inf/NaN; the inner one then applies them as
        they are (``reduced_here``)."""
        if _reduction(optimizer) is None:
            distribute(optimizer, self)

    # -- the reduction ------------------------------------------------------------------
    def host(self, *arrays) -> tuple:
        """``reduce_host`` as the body of a host callback (it must not wait for itself)."""
        from mpistrat.collectives import host_callbacks
        with host_callbacks.running():
            return self.reduce_host(*arrays)

    def each_device(self, count: int, site, position, *arrays) -> tuple:
        """Device ``position``'s part of one reduction of all ``count`` devices' gradients
        (inside ``shard_map``/``pmap``): device ``i``'s meet device ``i``'s of every rank."""
        from mpistrat.collectives import host_callbacks
        timeout = self.strategy.extended.engine.options.timeout_seconds
        return tuple(host_callbacks.gathered_flat(
            count, int(position), [np.asarray(a) for a in arrays],
            lambda flat: self.reduce_host(*flat, devices=count), timeout, site))

    def reduce_host(self, *arrays, devices: int = 0) -> tuple:
        """Reduce host copies of the gradients by Horovod's rules; each result in its
        gradient's dtype and shape (collective). ``devices``: the per-device calls joined
        (ranks with other device counts then differ by name)."""
        from mpistrat.horovod.collectives import Average, _scale
        arrays = [np.asarray(a) for a in arrays]
        wires, contexts = [], []
        for value in arrays:
            wire, context = self.compression.compress(value)
            wire = np.asarray(wire)
            if self.prescale != 1.0:
                wire = _scale(wire, self.prescale)
            wires.append(wire)
            contexts.append(context)
        engine = self.strategy.extended.engine
        label = self.label() + (f", {devices} devices per rank" if devices else "")
        summed = engine.all_reduce(wires, "SUM", label=label)
        post = self.postscale / engine.size if self.op == Average else self.postscale
        out = []
        for value, total, context in zip(arrays, summed, contexts):
            total = np.asarray(total)
            if post != 1.0:
                total = _scale(total, post)
            back = np.asarray(self.compression.decompress(total, context))
            out.append(back.astype(value.dtype, copy=False).reshape(value.shape))
        return tuple(out)

    def reduce(self, grads: List[Any]) -> List[Any]:
        """``grads`` (a list; ``None`` kept where it is) reduced over the ranks: eagerly on the
        host, or through an ordered host callback when traced (inside ``jax.jit``)."""
        where = [i for i, g in enumerate(grads) if g is not None]
        present = [grads[i] for i in where]
        out = list(grads)
        if not present:
            return out
        if _traced(present):
            import jax
            from jax.experimental import io_callback
            from mpistrat.collectives import host_callbacks
            axes = host_callbacks.per_device_axes("hvd.DistributedOptimizer")
            host_callbacks.traced()   # the program's own collectives now wait for these
            shapes = tuple(jax.ShapeDtypeStruct(np.shape(g), g.dtype) for g in present)
            if not axes:
                reduced = io_callback(self.host, shapes, *present, ordered=True)
            else:   # inside shard_map/pmap: once per device, joined into one collective
                mesh = jax.sharding.get_abstract_mesh()
                count = int(np.prod([mesh.shape[a] for a in axes]))
                site = host_callbacks.site(f"hvd.DistributedOptimizer{host_callbacks.traced_at()}")
                reduced = io_callback(functools.partial(self.each_device, count, site), shapes,
                                      jax.lax.axis_index(axes), *present, ordered=True)
        else:
            import jax.numpy as jnp
            from mpistrat.runtime.devices import array_kind
            reduced = [jnp.asarray(r) if array_kind(g) == "jax" else r   # (settles first:
                       for r, g in zip(self.reduce_host(*present), present)]   # program order)
        for i, r in zip(where, reduced):
            out[i] = r
        return out

    def accumulate(self, grads: List[Any]) -> Optional[List[Any]]:
        """One backward pass of ``backward_passes_per_step``: add ``grads`` to this rank's
        sums; ``None`` until the N-th pass, which returns the sums and starts over. Eager
        only."""
        for i, g in enumerate(grads):
            if g is None:
                continue
            value = np.asarray(g)
            self.aggregated[i] = value.copy() if i not in self.aggregated else \
                self.aggregated[i] + value
        self.counter += 1
        if self.counter < self.passes:
            return None
        summed = [None if g is None else self.aggregated.get(i) for i, g in enumerate(grads)]
        self.counter, self.aggregated = 0, {}
        return summed

    def after_passes(self, reduced: List[Any]) -> List[Any]:
        """The reduced sums of N passes, divided by N with ``average_aggregated_gradients``
        (after the reduction, as Horovod divides)."""
        if not self.average_aggregated:
            return reduced
        return [None if r is None else r / np.asarray(self.passes, np.asarray(r).dtype)
                for r in reduced]

    def refuse_traced_passes(self, what: str) -> None:
        if self.passes > 1:
            from mpistrat.horovod.world import NotSupportedError
            raise NotSupportedError(
                f"hvd.DistributedOptimizer(backward_passes_per_step={self.passes}): {what} is "
                f"not supported with it (the passes are summed on the host between eager "
                f"calls); call optimizer.apply_gradients(...) eagerly, outside jax.jit, or give "
                f"DistributedOptimizer an optax transformation, which accumulates inside jit")

    def for_fit(self) -> Any:
        """The train step's reduction of each rank's mean gradient (traced), or ``None`` for
        Horovod's default, which the step reduces weighted by rows with its other sums.
        ``backward_passes_per_step`` other than 1 is refused by name here."""
        if self.passes > 1:
            from mpistrat.horovod.world import NotSupportedError
            raise NotSupportedError(
                f"model.fit with hvd.DistributedOptimizer(backward_passes_per_step="
                f"{self.passes}) is not supported: fit's train step is compiled and applies "
                f"every step. Accumulate in a custom loop (optimizer.apply_gradients, which "
                f"honours backward_passes_per_step as Horovod does), or give the Keras "
                f"optimizer gradient_accumulation_steps={self.passes} with "
                f"backward_passes_per_step=1 (Keras applies the mean of the {self.passes} "
                f"averaged gradients: Horovod's average_aggregated_gradients=True)")
        if self.is_plain():
            return None
        return self.reduce


# -- the optimizer's methods, per instance -----------------------------------------------------

def _reduction(optimizer: Any) -> Optional[GradientReduction]:
    return getattr(optimizer, "_mpistrat_hvd_reduction", None)


def _apply(self, grads, trainable_variables=None):
    """``apply`` of a ``DistributedOptimizer``: the gradients reduced over the ranks first
    (after ``backward_passes_per_step`` local passes), then Keras's own ``apply``."""
    original = type(self).apply
    reduction = _reduction(self)
    grads = list(grads)
    if reduction is None or reduced_already() or not grads:
        return original(self, grads, trainable_variables)
    present = [g for g in grads if g is not None]
    if reduction.passes > 1:
        if _traced(present):
            reduction.refuse_traced_passes("optimizer.apply inside jax.jit")
        summed = reduction.accumulate(grads)
        if summed is None:   # Horovod: no reduction, no update; the iteration counts
            self.iterations.assign_add(1)
            return None
        reduced = reduction.after_passes(reduction.reduce(summed))
    else:
        reduced = reduction.reduce(grads)
    with reduced_here():
        return original(self, reduced, trainable_variables)


def _stateless_apply(self, optimizer_variables, grads, trainable_variables):
    """``stateless_apply`` of a ``DistributedOptimizer`` called in a loop of one's own: the
    gradients reduced over the ranks first (an ordered host callback inside ``jax.jit``)."""
    original = type(self).stateless_apply
    reduction = _reduction(self)
    if reduction is None or reduced_already():
        return original(self, optimizer_variables, grads, trainable_variables)
    reduction.refuse_traced_passes("optimizer.stateless_apply")
    reduced = reduction.reduce(list(grads))
    with reduced_here():
        return original(self, optimizer_variables, reduced, trainable_variables)


def distribute(optimizer: Any, reduction: GradientReduction) -> Any:
    """Make ``optimizer`` (a Keras 3 optimizer) reduce with ``reduction`` wherever it is handed
    gradients (its own ``apply``/``stateless_apply``; ``apply_gradients`` calls ``apply``).
    Per instance: the class, and every other optimizer, are untouched."""
    optimizer._mpistrat_horovod = reduction.strategy
    optimizer._mpistrat_hvd_reduction = reduction
    optimizer.apply = types.MethodType(_apply, optimizer)
    optimizer.stateless_apply = types.MethodType(_stateless_apply, optimizer)
    return optimizer


# -- optax -------------------------------------------------------------------------------------

def optax_transformation(tx: Any, reduction: GradientReduction) -> Any:
    """``tx`` after Horovod's reduction of the updates (inside ``jax.jit`` too). With
    ``backward_passes_per_step=N``: the updates of N calls summed in the state, zero updates
    (and ``tx``'s state kept) on the others, and on the N-th the sum (over N with
    ``average_aggregated_gradients``) reduced and handed to ``tx``."""
    import jax
    import jax.numpy as jnp
    import optax

    def reduce_tree(tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, reduction.reduce(leaves))

    if reduction.passes == 1:
        def init(params):
            return tx.init(params)

        def update(updates, state, params=None, **extra):
            return tx.update(reduce_tree(updates), state, params, **extra)

        return optax.GradientTransformationExtraArgs(init, update)

    passes = reduction.passes

    def init_passes(params):
        return {"count": jnp.zeros((), jnp.int32),
                "sum": jax.tree_util.tree_map(jnp.zeros_like, params),
                "inner": tx.init(params)}

    def update_passes(updates, state, params=None, **extra):
        summed = jax.tree_util.tree_map(lambda s, u: s + u.astype(s.dtype), state["sum"],
                                        updates)
        count = state["count"] + 1

        def emit(operands):
            summed, inner = operands
            reduced = reduce_tree(summed)
            if reduction.average_aggregated:
                reduced = jax.tree_util.tree_map(lambda r: r / passes, reduced)
            new_updates, new_inner = tx.update(reduced, inner, params, **extra)
            return (jax.tree_util.tree_map(lambda u, s: u.astype(s.dtype), new_updates,
                                           summed),
                    new_inner, jax.tree_util.tree_map(jnp.zeros_like, summed),
                    jnp.zeros((), jnp.int32))

        def hold(operands):
            summed, inner = operands
            return (jax.tree_util.tree_map(jnp.zeros_like, summed), inner, summed, count)

        new_updates, inner, summed, count = jax.lax.cond(count >= passes, emit, hold,
                                                         (summed, state["inner"]))
        return new_updates, {"count": count, "sum": summed, "inner": inner}

    return optax.GradientTransformationExtraArgs(init_passes, update_passes)
