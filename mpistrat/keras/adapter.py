"""The one place mpistrat uses Keras's private API (``keras.src``, ``Model._...``).

Everything else in the Keras support takes Keras 3's public names (``keras.StatelessScope``,
``keras.utils.unpack_x_y_sample_weight``, ``Model.compute_loss_and_updates``,
``optimizer.stateless_apply``, ``keras.utils.PyDataset``, callbacks). Two things have no
public form, and live here, each checked before use so that a Keras that moved them gives
an error naming the Keras version and the tested range, not an ``AttributeError`` deep in a
train step:

* ``update_metrics``: a train step's metric variables after one batch
  (``Model._update_metrics_variables``: the compiled metrics and the loss tracker, with
  sample weights, as Keras's own train step updates them);
* ``replica_losses``: a replica's losses scaled as Keras's TensorFlow backend scales them
  under a strategy of N replicas (``keras.src.losses.loss.scale_loss_for_distribution`` and
  its inverse, and ``Trainer._aggregate_additional_loss``; no-ops on JAX otherwise), an
  empty batch's loss 0 (``keras.src.losses.loss.reduce_values``);
* ``weight_regularisation_loss``: the weight regularisers' share of a replica's loss at given
  trainable values, aggregated as ``Trainer.compute_loss`` aggregates them
  (``Trainer._aggregate_additional_loss``): what an empty replica's gradient comes from;
* ``each_epoch``: a Keras ``DataAdapter`` (``keras.src.trainers.data_adapters``) that
  iterates an mpistrat distributed dataset afresh each epoch; a ``PyDataset`` needs a length
  or an infinite stream, and Python generators are iterated once;
* ``build_on_empty_batches``: Keras's symbolic build at the start of ``fit``/``evaluate``
  (shapes of the first batch, ``Trainer._symbolic_build``) on a rank whose first batch has
  no rows;
* ``own_state``: a layer's own variables, seed generators and sublayers, apart (the
  checkpoint's object graph, as TensorFlow's names it; ``layer.variables`` mixes a layer's
  own with its sublayers');
* ``optimizer_state``: an optimizer's learning-rate variable and its per-variable slot
  lists (``_momentums``, ...), named as TensorFlow's checkpoints name them;
* ``initial_epoch`` / ``set_initial_epoch``: the epoch ``BackupAndRestore`` resumes at
  (``Model._initial_epoch``), shared from rank 0;
* ``reload_state``: a model in ``fit`` reads its variables again at the next step (after a
  callback assigned them: ``Model._jax_state_synced``);
* ``momentum_slots``: each trained variable of an ``SGD`` or ``RMSprop`` with its momentum
  buffer (``momentums`` / ``_momentums``, paired by ``_get_variable_index``), for Horovod's
  momentum correction;
* ``rebuild_optimizer`` / ``h5_optimizer_weights``: an optimizer Keras's legacy ``.h5``
  loader built on no variables, built on the model's, and the optimizer weights such a file
  holds (``keras.src.legacy.saving``), for ``hvd.load_model``;
* ``in_stateless_scope`` / ``set_initial_value``: whether Keras runs in a ``StatelessScope``
  (a layer built inside a symbolic run of its caller, where assignments are dropped), and a
  variable made there, not initialized yet, given a restored value as its initial value
  (``_value``, ``_initializer``), for checkpoint restores into layers built later.

Tested against Keras 3.15.1 (the newest; ``pyproject.toml`` allows 3.10 and later)::

    >>> from mpistrat.keras.adapter import TESTED
    >>> TESTED
    '3.15.1'
"""

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["update_metrics", "replica_losses", "weight_regularisation_loss", "each_epoch",
           "build_on_empty_batches", "own_state", "optimizer_state",
           "initial_epoch", "set_initial_epoch", "reload_state", "momentum_slots",
           "rebuild_optimizer", "h5_optimizer_weights", "in_stateless_scope",
           "set_initial_value", "TESTED"]

TESTED = "3.15.1"   # the Keras versions whose private names below were checked


def _missing(what: str) -> RuntimeError:
    import keras
    return RuntimeError(
        f"Keras {keras.__version__} has no {what}, which mpistrat's Keras support needs "
        f"(tested with Keras {TESTED}; mpistrat/keras/adapter.py is the one place that uses "
        f"Keras's private API)")


def update_metrics(model: Any, metrics_variables, unscaled_loss, x, y, y_pred,
                   sample_weight) -> list:
    """``model``'s metric variables after one batch, statelessly: Keras's own update of
    its loss tracker and compiled metrics (``Model._update_metrics_variables`` of the JAX
    trainer), from ``metrics_variables`` (the values before the batch)."""
    update = getattr(model, "_update_metrics_variables", None)
    if update is None:
        raise _missing("Model._update_metrics_variables")
    return update(metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)[1]


@contextlib.contextmanager
def replica_losses(model: Any, replicas: int):
    """Within it (while a step is traced), ``model``'s losses are one replica's share as
    Keras's TensorFlow backend computes them under a strategy of ``replicas`` replicas: a
    mean loss (``sum_over_batch_size``, ``mean``, ``mean_with_sample_weight``) and each
    regularisation loss times ``1 / replicas``, a summed loss as it is, and the per-output
    loss metrics given the loss times ``replicas``; a replica without rows reduces its empty
    batch to 0, as TensorFlow's traced shapes (batch size unknown) do, where Keras on JAX
    would hand back the empty array (which a regularisation loss cannot be added to). Keras's
    JAX backend keeps the scaling as no-ops (``scale_loss_for_distribution`` acts for
    TensorFlow alone); these are set for the trace and put back after it (a step traced in
    another thread meanwhile would see them)::

        with replica_losses(model, 2):
            loss, aux = model.compute_loss_and_updates(...)
    """
    try:
        from keras.src.losses import loss as losses
        saved = {name: getattr(losses, name) for name in (
            "reduce_values", "scale_loss_for_distribution", "unscale_loss_for_distribution")}
        aggregate = type(model)._aggregate_additional_loss
    except (ImportError, AttributeError):
        raise _missing("keras.src.losses.loss.reduce_values / scale_loss_for_distribution / "
                       "unscale_loss_for_distribution, Trainer._aggregate_additional_loss") \
            from None
    from keras import ops
    reduce = saved["reduce_values"]

    def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
        if tuple(values.shape) == (0,) and reduction not in (None, "none"):
            return ops.sum(values)   # (0: the sum of nothing, and a mean's divide_no_nan)
        return reduce(values, sample_weight, reduction)

    def scaled(value):   # (the operations of Keras's TensorFlow branch)
        return ops.multiply(value, ops.cast(1.0 / replicas, value.dtype))

    def unscaled(value):
        return ops.multiply(value, ops.cast(replicas, value.dtype))

    losses.reduce_values = reduce_values
    if replicas > 1:
        losses.scale_loss_for_distribution = scaled
        losses.unscale_loss_for_distribution = unscaled
        object.__setattr__(model, "_aggregate_additional_loss",
                           lambda loss: scaled(aggregate(model, loss)))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(losses, name, value)
        if replicas > 1:
            object.__delattr__(model, "_aggregate_additional_loss")


def weight_regularisation_loss(model: Any, trainable_values) -> Any:
    """The sum of ``model``'s weight-regularisation losses at ``trainable_values`` (in the
    order of ``model.trainable_variables``), each aggregated as ``Trainer.compute_loss``
    aggregates ``model.losses`` (``_aggregate_additional_loss``: inside ``replica_losses``,
    one replica's share), and summed as it sums them; 0 when no variable has a regulariser.
    Its gradient is a replica's gradient without data, activity regularisers or ``add_loss``
    terms (each term depends on its own variable alone, so the gradient is exactly the
    regularisers' part of the whole loss's)."""
    from keras import ops
    aggregate = getattr(model, "_aggregate_additional_loss", None)
    if aggregate is None:
        raise _missing("Trainer._aggregate_additional_loss")
    terms = [aggregate(variable.regularizer(value)) for variable, value in
             zip(model.trainable_variables, trainable_values)
             if getattr(variable, "regularizer", None) is not None]
    if not terms:
        return ops.zeros(())
    return terms[0] if len(terms) == 1 else ops.sum(terms)


def each_epoch(batches: Callable[[], Iterator]) -> Any:
    """A Keras data adapter whose every epoch iterates ``batches()`` afresh (its length
    unknown to Keras, as a generator's)."""
    try:
        from keras.src.trainers.data_adapters import data_adapter, data_adapter_utils
    except ImportError:
        raise _missing("keras.src.trainers.data_adapters") from None

    class Epochs(data_adapter.DataAdapter):
        def get_numpy_iterator(self):
            return data_adapter_utils.get_numpy_iterator(batches())

        def get_jax_iterator(self):
            return data_adapter_utils.get_jax_iterator(batches())

        num_batches = batch_size = has_partial_batch = partial_batch_size = property(
            lambda self: None)

    return Epochs()


def build_on_empty_batches(model: Any) -> None:
    """Let Keras's symbolic build (``Trainer._symbolic_build``, run at the start of
    ``fit``/``evaluate`` on the first batch's shapes, while anything is unbuilt) work on a
    rank whose first batch has no rows: a leading dimension of 0 is traced as ``None`` (any
    rows), as a ``keras.Input`` is; a ``(0,)`` data loss cannot be added to a regularisation
    loss. Ranks with rows build on their batch's shapes as Keras does; a built model takes no
    batch (as Keras's). Per instance, wrapping the class's method (again: no nesting)."""
    original = getattr(type(model), "_symbolic_build", None)
    if original is None or not hasattr(model, "_flatten_layers"):
        raise _missing("Trainer._symbolic_build")
    try:
        from keras import KerasTensor, tree
        from keras.src.backend import standardize_dtype
    except ImportError:
        raise _missing("keras.src.backend.standardize_dtype") from None

    def any_rows(value):
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != 0:
            return value
        return KerasTensor((None,) + tuple(shape[1:]), standardize_dtype(value.dtype))

    def unbuilt():   # (Keras's own test: it takes a batch only then)
        return not all(layer.built for layer in model._flatten_layers()) or any(
            part is not None and not part.built
            for part in (getattr(model, "_compile_metrics", None),
                         getattr(model, "_compile_loss", None)))

    def build(iterator=None, data_batch=None):
        if data_batch is None and iterator is not None and unbuilt():   # (Keras's own batch)
            for _, _, data_or_iterator in iterator:
                data_batch = data_or_iterator[0] if isinstance(data_or_iterator, (list, tuple)) \
                    else next(data_or_iterator)
                break
        if data_batch is not None:
            data_batch = tree.map_structure(any_rows, data_batch)
        return original(model, iterator=iterator, data_batch=data_batch)

    object.__setattr__(model, "_symbolic_build", build)   # (once: the class's is wrapped)


def own_state(layer: Any):
    """``(own variables, seed generators, sublayers)`` of a Keras layer: its trainable then
    non-trainable variables (not its sublayers'), its seed generators, and the layers it
    tracks, in the order Keras made them."""
    try:
        variables = list(layer._trainable_variables) + list(layer._non_trainable_variables)
        return variables, list(getattr(layer, "_seed_generators", ())), list(layer._layers)
    except AttributeError:
        raise _missing("Layer._trainable_variables / _non_trainable_variables / _layers") \
            from None


def initial_epoch(model: Any):
    """The epoch ``fit`` starts at after ``BackupAndRestore`` restored (None: not set)."""
    return getattr(model, "_initial_epoch", None)


def set_initial_epoch(model: Any, epoch: int) -> None:
    """Make ``fit`` start at ``epoch`` (as ``BackupAndRestore``'s restore does)."""
    model._initial_epoch = epoch


def optimizer_state(optimizer: Any):
    """``(learning-rate variable or None, [(slot name, per-variable list)])`` of a Keras
    optimizer: the lists as long as its trainable variables (``momentums``, ...), sorted."""
    count = len(getattr(optimizer, "_trainable_variables", ()))
    slots = [(name.lstrip("_"), value) for name, value in sorted(vars(optimizer).items())
             if name not in ("_variables", "_trainable_variables") and count and
             isinstance(value, (list, tuple)) and len(value) == count]
    return getattr(optimizer, "_learning_rate", None), slots


def reload_state(model: Any) -> None:
    """Make a model in ``fit`` take its variables again at its next step (a callback
    assigned them: the learning rate, broadcast weights)."""
    if hasattr(model, "_jax_state_synced"):
        model._jax_state_synced = True


def momentum_slots(optimizer: Any) -> list:
    """``[(variable, momentum buffer)]`` of a built Keras ``SGD`` or ``RMSprop`` with a
    momentum: each variable it trains with the buffer its step multiplies by the momentum."""
    try:
        buffers = optimizer.momentums if hasattr(optimizer, "momentums") else \
            optimizer._momentums
        return [(variable, buffers[optimizer._get_variable_index(variable)])
                for variable in optimizer._trainable_variables]
    except AttributeError:
        raise _missing("SGD.momentums / RMSprop._momentums / Optimizer._trainable_variables "
                       "/ Optimizer._get_variable_index") from None


def rebuild_optimizer(optimizer: Any, variables: list) -> bool:
    """Build ``optimizer`` on ``variables`` if it was built on none (Keras 3's legacy ``.h5``
    loader builds it on a model's own variables, none for a ``Sequential``); ``False`` when it
    trains variables already (left as it is)."""
    if getattr(optimizer, "_trainable_variables", None):
        return False
    optimizer.built = False
    optimizer.build(variables)
    return True


def h5_optimizer_weights(group: Any) -> list:
    """The optimizer weights a legacy ``.h5`` file (an open ``h5py`` group) holds, in the
    optimizer's variable order (``[]`` when it holds none)."""
    if "optimizer_weights" not in group:
        return []
    try:
        from keras.src.legacy.saving.legacy_h5_format import \
            load_optimizer_weights_from_hdf5_group
    except ImportError:
        raise _missing("keras.src.legacy.saving.legacy_h5_format."
                       "load_optimizer_weights_from_hdf5_group") from None
    return list(load_optimizer_weights_from_hdf5_group(group))


def in_stateless_scope() -> bool:
    """Whether Keras runs inside a ``StatelessScope`` (a layer built by a symbolic run of its
    caller: what is assigned there is dropped when the scope ends), so a checkpoint restore
    waits for the build that ends outside it."""
    try:
        from keras.src.backend.common.stateless_scope import in_stateless_scope as probe
    except ImportError:
        raise _missing("keras.src.backend.common.stateless_scope.in_stateless_scope") from None
    return bool(probe())


def set_initial_value(variable: Any, value) -> bool:
    """Give ``value`` to a Keras variable made inside a ``StatelessScope`` and not initialized
    yet (``_value`` is ``None``; Keras initializes it from ``_initializer`` when the scope
    ends), as its initial value; ``False`` (nothing done) for any other variable."""
    if getattr(variable, "_value", 0) is not None or \
            not callable(getattr(variable, "_initializer", None)):
        return False
    import numpy as np
    array = np.array(value)
    variable._initializer = lambda shape, dtype=None: array
    return True
