"""``hvd.DistributedOptimizer`` and ``hvd.load_model``: a Keras 3 optimizer (or an optax
transformation) made to reduce its gradients over the ranks by Horovod's rules, its options
checked here and the reduction itself in ``optimizer.py``; and a saved model loaded with its
optimizer so wrapped (its state restored, a legacy ``.h5`` file's too)::

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model = hvd.load_model("model.keras")      # its optimizer wrapped the same way
"""

from typing import Any

import numpy as np

from mpistrat.horovod.collectives import Average, Sum
from mpistrat.horovod.compression import Compression
from mpistrat.horovod.world import NotSupportedError, _strategy, global_process_set


def DistributedOptimizer(optimizer: Any, name: str = None, device_dense: str = "",  # noqa: N802
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """``optimizer`` (a Keras 3 optimizer) reducing over the ranks every gradient it is
    handed, by Horovod's rules; returns the same optimizer object::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        model.compile(optimizer=opt, loss="mse")    # fit: each rank its own rows
        opt.apply_gradients(zip(grads, model.trainable_variables))   # or a custom loop

    In ``model.fit`` the distributed train step reduces each step's gradients (the default
    average weighted by rows, Horovod's when the ranks' batches are equal); in a custom loop
    ``apply_gradients``/``apply`` reduce them on the host first, and ``stateless_apply`` in a
    host callback (inside ``jax.jit`` too). ``op``: ``Average`` (the default) or ``Sum``
    (Horovod's Keras optimizer takes no other); ``gradient_predivide_factor`` ``f``: the
    average as ``1/f`` before the sum and ``f/size`` after it; ``compression``: on the wire
    (``Compression.fp16``); ``backward_passes_per_step=N``: N calls summed on this rank (the
    weights unchanged, ``iterations`` counting each call), the N-th reduces the sum (divided
    by N with ``average_aggregated_gradients=True``) and applies it. ``model.fit`` refuses
    ``N > 1`` by name (its step applies every step), and so does ``stateless_apply``.
    ``device_dense``, ``device_sparse``, ``sparse_as_dense``, ``num_groups`` and ``groups``
    change how Horovod schedules its transfers, not the numbers: accepted and unused (JAX's
    gradients are dense). ``process_set``: the global one only. ``scale_local_gradients``:
    there are no local variables (``register_local_var`` is Horovod's), so it changes nothing.

    Given an optax ``GradientTransformation``, returns one that reduces the updates the same
    way (inside ``jax.jit`` too; ``backward_passes_per_step`` accumulated in its state)
    before the given one sees them::

        tx = hvd.DistributedOptimizer(optax.adam(1e-3))
        opt_state = tx.init(params)       # then tx.update(grads, opt_state, params) per step
    """
    what = "hvd.DistributedOptimizer"
    reduction = _gradient_reduction(what, name, compression, gradient_predivide_factor, op,
                                    backward_passes_per_step, average_aggregated_gradients,
                                    process_set)
    from mpistrat.horovod import optimizer as distributed
    if not hasattr(optimizer, "apply_gradients") and hasattr(optimizer, "update") and \
            hasattr(optimizer, "init"):                       # an optax transformation
        return distributed.optax_transformation(optimizer, reduction)
    if not hasattr(optimizer, "apply") or not hasattr(optimizer, "stateless_apply"):
        raise TypeError(f"{what}: {type(optimizer).__name__} is neither a Keras 3 optimizer "
                        f"nor an optax GradientTransformation")
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if reduction.passes > 1 and getattr(inner, "gradient_accumulation_steps", None):
        raise NotSupportedError(f"{what}: backward_passes_per_step={reduction.passes} with an "
                                f"optimizer that accumulates itself (gradient_accumulation_steps="
                                f"{inner.gradient_accumulation_steps}) would accumulate twice; "
                                f"give one of them")
    from mpistrat.keras import hooks
    hooks.install()
    return distributed.distribute(optimizer, reduction)


def _gradient_reduction(what: str, name: Any = None, compression: Any = Compression.none,
                        gradient_predivide_factor: float = 1.0, op: Any = Average,
                        backward_passes_per_step: int = 1,
                        average_aggregated_gradients: bool = False,
                        process_set: Any = None) -> Any:
    """``DistributedOptimizer``'s options checked (on this rank alone: ``load_model`` may run
    on rank 0 only, as Horovod's resume examples do), as a ``GradientReduction``."""
    if op not in (Average, Sum):
        raise NotSupportedError(f"{what}: op={op!r} is not supported; Horovod's Keras "
                                f"DistributedOptimizer reduces gradients with op=hvd.Average "
                                f"or op=hvd.Sum only")
    if compression is None:
        compression = Compression.none
    if not (callable(getattr(compression, "compress", None)) and
            callable(getattr(compression, "decompress", None))):
        raise ValueError(f"{what}: compression={compression!r} is not a compressor "
                         f"(Compression.none, Compression.fp16, or a class with compress and "
                         f"decompress)")
    if isinstance(backward_passes_per_step, bool) or \
            not isinstance(backward_passes_per_step, (int, np.integer)) or \
            backward_passes_per_step <= 0:
        raise ValueError(f"{what}: backward_passes_per_step={backward_passes_per_step!r} must "
                         f"be an integer > 0")
    try:
        predivide = float(np.float32(float(gradient_predivide_factor)))
    except (TypeError, ValueError):
        raise TypeError(f"{what}: gradient_predivide_factor={gradient_predivide_factor!r} is "
                        f"not a number") from None
    if predivide == 0.0:
        raise ValueError(f"{what}: gradient_predivide_factor=0 divides by zero")
    if not (process_set is None or process_set is global_process_set or
            getattr(process_set, "process_set_id", None) == 0):
        raise NotSupportedError(f"{what}: process_set={process_set!r} is not supported; "
                                f"mpistrat.horovod reduces over every rank "
                                f"(global_process_set)")
    from mpistrat.horovod.optimizer import GradientReduction
    return GradientReduction(_strategy(), op, compression, predivide,
                             int(backward_passes_per_step), bool(average_aggregated_gradients),
                             name)


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """``keras.models.load_model(filepath)`` with the loaded model's optimizer wrapped in
    ``hvd.DistributedOptimizer`` (its state restored), ready to ``fit`` on every rank
    (Horovod's ``load_model``), from a ``.keras`` file or a legacy ``.h5`` one::

        model = hvd.load_model("model.keras")      # each rank then fits on its own rows

    ``custom_optimizers``: optimizer classes of your own the file names (found by their class
    names); ``custom_objects``: Keras's. Any optimizer the file holds is wrapped, Keras's own
    or yours. ``compression`` is ``DistributedOptimizer``'s; ``legacy_opts=True``
    (``tf.keras.optimizers.legacy``) is refused: Keras 3 has no legacy optimizers. A legacy
    ``.h5`` file's optimizer state (momentums, ...) is restored too (Keras 3 alone leaves it
    fresh). A model saved without compiling comes back as it is. Needs ``init()``; no
    collective, so Horovod's resume works as there: rank 0 loads, the other ranks build and
    compile afresh, and ``BroadcastGlobalVariablesCallback(0)`` gives every rank rank 0's
    model and optimizer after the first batch (or load on every rank, from a file every rank
    can read)."""
    what = "hvd.load_model"
    if legacy_opts:
        raise NotSupportedError(f"{what}(legacy_opts=True): Keras 3 has no legacy optimizers "
                                f"(tf.keras.optimizers.legacy); load with legacy_opts=False")
    _gradient_reduction(what, compression=compression)   # (refused before the file is read)
    strategy = _strategy()
    import keras
    objects = {cls.__name__: cls for cls in (custom_optimizers or ())}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(model, "compiled", True):
        return model
    if _is_h5(filepath):
        _restore_h5_optimizer(model, filepath)
    DistributedOptimizer(optimizer, compression=compression)
    from mpistrat.keras.trainer import distribute_model
    distribute_model(model, strategy, per_rank_data=True)   # (as compile would have)
    return model


def _is_h5(filepath: Any) -> bool:
    if type(filepath).__module__.startswith("h5py"):
        return True
    return str(filepath).endswith((".h5", ".hdf5"))


def _restore_h5_optimizer(model: Any, filepath: Any) -> None:
    """Keras 3 builds a legacy ``.h5`` file's optimizer on no variables and sets only its
    first weights (the iteration count, the rate): build it on the model's trainable
    variables and set every saved weight, as Keras 2 did. A state that does not fit warns
    and leaves the optimizer fresh, as Keras's loader does."""
    import warnings

    import h5py
    from mpistrat.keras.adapter import h5_optimizer_weights, rebuild_optimizer
    optimizer = model.optimizer
    try:
        opened = filepath if isinstance(filepath, (h5py.File, h5py.Group)) else \
            h5py.File(filepath, "r")
        try:
            saved = [np.asarray(value) for value in h5_optimizer_weights(opened)]
        finally:
            if opened is not filepath:
                opened.close()
    except (OSError, KeyError, ValueError) as err:
        warnings.warn(f"hvd.load_model: the optimizer state of {filepath!r} could not be read "
                      f"({type(err).__name__}: {err}); the optimizer starts fresh",
                      RuntimeWarning, stacklevel=3)
        return
    if not saved or len(saved) == len(optimizer.variables):
        return   # (nothing saved, or Keras restored it)
    if not hasattr(optimizer, "inner_optimizer"):   # (a LossScaleOptimizer: left to Keras)
        rebuild_optimizer(optimizer, model.trainable_variables)
    variables = optimizer.variables
    if len(saved) != len(variables) or any(tuple(v.shape) != s.shape
                                           for v, s in zip(variables, saved)):
        warnings.warn(f"hvd.load_model: the optimizer state of {filepath!r} ({len(saved)} "
                      f"weights) does not fit {type(optimizer).__name__} ({len(variables)} "
                      f"variables); the optimizer starts fresh", RuntimeWarning, stacklevel=3)
        return
    for variable, value in zip(variables, saved):
        variable.assign(value)
