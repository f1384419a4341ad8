"""Keras 3 (JAX backend) ``fit``/``evaluate``/``predict`` data parallel under a strategy.

A model compiled inside ``strategy.scope()`` of a ``MultiWorkerMirroredStrategy`` or
``MirroredStrategy`` trains across the MPI ranks, as a TensorFlow model compiled under
``tf.distribute.MultiWorkerMirroredStrategy`` does::

    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=64, epochs=2)   # 64 rows per global batch, split over ranks
    model.evaluate(x, y, batch_size=64)        # the same logs on every rank

What changes for a compiled model (instance attributes; the Keras classes are untouched):

* NumPy arrays given to ``fit``/``evaluate`` are cut into global batches of ``batch_size``
  rows; each rank takes its slice of every global batch by TensorFlow's rebatch rule
  (``mpistrat.data.rebatch.rebatch_slices``: ``ceil(B/N)`` rows per replica, later replicas
  may get 0 rows). ``shuffle=True`` permutes the rows once per epoch with the same seeded
  order on every rank (seed ``keras_shuffle_seed``, default 0).
* The train step (``steps.py``) weights each replica's gradient by its row count and
  sums over the ranks (one ordered host all-reduce per step, ``ms.nn.all_reduce_gradients``),
  so the update is the gradient of the loss averaged over the global batch, as one process
  would compute it. A loss with ``reduction="sum"`` follows TensorFlow's rule instead (each
  replica's losses scaled as Keras's TensorFlow backend scales them, the gradients summed,
  the logged loss N times the replica's), with TensorFlow's weights and logged loss.
* Metric variables: each step's change is summed over the ranks, so the loss tracker and
  additive metrics (``Mean``, accuracy, ``MeanSquaredError``, confusion counts) hold the
  global values on every rank; per-step and epoch logs agree across ranks.
* ``predict`` of NumPy (or JAX) arrays is sharded: each rank predicts its contiguous block
  of the rows (``mpistrat.partition.even_ranges``), and one ``all_gather`` per output puts
  the blocks together in order, so every rank returns every row's prediction, as one process
  would (batch inference at N ranks costs about 1/N of the forward passes). Other inputs
  (generators, ``ms`` datasets) are predicted whole on every rank.

* Weights: a compile inside the scope gives every rank rank 0's values of the model's
  variables (or ``fit`` does, when the model is built only then), so ranks never train
  apart from different initial values, seeded or not (``mirror_weights``). Under
  ``mpistrat.horovod`` (``per_rank_data``) nothing is sent at compile, as in Horovod:
  ``BroadcastGlobalVariablesCallback`` gives every rank its root's after the first batch,
  and ranks that start apart without it raise by name when training starts.
* Non-trainable state the step writes (BatchNormalization's moving statistics, renorm's
  too) is averaged over the ranks that had rows at each step: the mean of the copies each
  replica would keep (the update is linear), the same on every rank, so a checkpoint takes it;
  seed generators advance alike everywhere (``steps.py``).
  ``SyncBatchNormalization`` (``sync_bn.py``) normalises with the global batch's
  statistics instead, as ``BatchNormalization(synchronized=True)`` does in TensorFlow.

Not done: metrics whose state is not a sum (e.g. ``max``) are wrong. An ``ms``
distributed dataset (``strategy.experimental_distribute_dataset``) is iterated afresh each
epoch as it is (it already gives each rank its share and stops on the same step everywhere);
Python generators and other inputs are passed to Keras unchanged and must do the same, except
under ``mpistrat.horovod``, where each rank's generator yields a batch only when every rank's
has one, and ranks whose generators run dry at different steps raise, naming each rank's count
(``checks.agreed_batches``).
"""

import math
from typing import Any

import numpy as np

from mpistrat.keras.adapter import build_on_empty_batches
from mpistrat.keras.callbacks import for_fit
from mpistrat.keras.checks import (_is_arrays, _rows, _split_off, agreed_batches,
                                   loss_rule, same_arrays_everywhere, same_steps_everywhere)
from mpistrat.keras.context import global_metrics
from mpistrat.keras.context import train_alone  # noqa: F401  (ms.keras.train_alone)
from mpistrat.keras.steps import _horovod_reduction, make_steps
from mpistrat.keras.sync_bn import bind as bind_sync_bn, synchronizes

__all__ = ["distribute_model", "DistributedTrainer", "mirror_weights", "train_alone",
           "SyncBatchNormalization"]


def __getattr__(name: str) -> Any:
    if name == "SyncBatchNormalization":   # (Keras is imported only when it is asked for)
        from mpistrat.keras.sync_bn import sync_batch_normalization_class
        return sync_batch_normalization_class()
    raise AttributeError(f"module 'mpistrat.keras.trainer' has no attribute {name!r}")

class _RankShare:
    """This rank's slice of every global batch of NumPy arrays (a ``keras.utils.PyDataset``)."""

    def __new__(cls, *args, **kwargs):
        import keras

        class RankShare(keras.utils.PyDataset):
            def __init__(self, arrays, batch_size, rank, size, shuffle, seed):
                super().__init__()
                self.arrays, self.batch_size = arrays, int(batch_size)
                self.rank, self.size, self.shuffle, self.seed = rank, size, shuffle, seed
                self.total = _rows(arrays)
                self.epoch = 0
                self.order = self._order()

            def _order(self):
                if not self.shuffle:
                    return None
                return np.random.default_rng((self.seed, self.epoch)).permutation(self.total)

            def __len__(self):
                return math.ceil(self.total / self.batch_size)

            def __getitem__(self, index):
                import jax
                from mpistrat.data.rebatch import rebatch_slices
                start = index * self.batch_size
                stop = min(start + self.batch_size, self.total)
                lo, hi = rebatch_slices(stop - start, self.size)[self.rank]
                rows = np.arange(start + lo, start + hi)
                if self.order is not None:
                    rows = self.order[rows]
                return jax.tree_util.tree_map(lambda a: np.asarray(a)[rows], self.arrays)

            def on_epoch_end(self):
                self.epoch += 1
                self.order = self._order()

        return RankShare(*args, **kwargs)


def _epochs_of(dataset):
    """A Keras data adapter that iterates an ``ms`` distributed dataset afresh each epoch."""
    from mpistrat.distribute.values import DistributedValues
    from mpistrat.keras.adapter import each_epoch

    def local(value):   # one replica per rank: the PerReplica's only component
        if isinstance(value, DistributedValues):
            (value,) = value.values
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(local(v) for v in value)
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        return value

    return each_epoch(lambda: (local(batch) for batch in dataset))


def _own_epochs(strategy, dataset, what: str):
    """A Keras data adapter over this rank's own ``ms.data.Dataset`` (Horovod's contract:
    per-rank data), iterated afresh each epoch; before each batch the ranks agree that each
    has one (``agreed_batches``), so datasets of different lengths raise on every rank naming
    each rank's count instead of leaving some waiting in the gradient all-reduce."""
    from mpistrat.keras.adapter import each_epoch
    from mpistrat.keras.checks import agreed_batches
    return each_epoch(lambda: agreed_batches(
        strategy, (batch for batch in dataset.as_numpy_iterator()), what))


def mirror_weights(model: Any, strategy: Any) -> None:
    """Give every rank rank 0's values of ``model``'s variables (collective), as variables
    created in a TensorFlow strategy's scope start from one replica's initial values."""
    variables = list(model.variables)
    if not variables or strategy.num_replicas_in_sync == 1:
        return
    values = strategy.extended.engine.broadcast([np.asarray(v.value) for v in variables], 0)
    for variable, value in zip(variables, values):
        variable.assign(value)


def distribute_model(model: Any, strategy: Any, per_rank_data: bool = False) -> Any:
    """Make ``model`` (compiled, Keras 3 on JAX) train and evaluate data parallel under
    ``strategy``; done by ``compile`` inside ``strategy.scope()``. Returns ``model``::

        ms.keras.distribute_model(model, strategy)   # compiled outside any scope

    ``per_rank_data=True`` is Horovod's contract (``mpistrat.horovod``): the arrays each rank
    passes are its own rows and ``batch_size`` is its own batch; the ranks must make the same
    number of steps (checked: a mismatch raises naming each rank's count, where Horovod
    would hang; generators are checked batch by batch); ``predict`` predicts this rank's rows
    only; no weights are sent (``BroadcastGlobalVariablesCallback`` does it after the first
    batch); an ``hvd.DistributedOptimizer`` with ``op=Sum``, compression or a predivide
    factor reduces each rank's mean gradient by Horovod's rules, and one with
    ``backward_passes_per_step`` other than 1 is refused by name.
    """
    if strategy.extended.replicas_in_compiled_steps:
        raise ValueError(f"model.fit under {type(strategy).__name__} is not supported: its "
                         f"replicas are devices inside compiled steps; use a custom loop")
    if getattr(model, "_mpistrat_strategy", None) is strategy:
        return model
    DistributedTrainer(model, strategy, per_rank_data).attach()
    return model


class DistributedTrainer:
    """One model's data-parallel training under one strategy (made by ``distribute_model``):
    its ``train_step``/``test_step`` (``steps.py``) and the ``fit``/``evaluate``/``predict``
    that ``attach()`` puts on the model instance (the Keras class is untouched), each calling
    the class's own with this rank's share of the data."""

    def __init__(self, model: Any, strategy: Any, per_rank_data: bool = False):
        from mpistrat.runtime import get_world
        self.model, self.strategy, self.per_rank_data = model, strategy, per_rank_data
        self.world = get_world()
        self.cls = type(model)
        bind_sync_bn(model, strategy)   # (layers made before the scope, or under hvd alone)
        self.synchronized = synchronizes(model)
        self.train_step, self.test_step = make_steps(model, strategy, per_rank_data,
                                                     self.synchronized)

    def attach(self) -> Any:
        """Give the model this trainer's steps and ``fit``/``evaluate``/``predict`` (instance
        attributes), and rank 0's weights if it is built (not under Horovod). Returns it."""
        model = self.model
        for name in ("train_step", "test_step", "fit", "evaluate", "predict"):
            object.__setattr__(model, name, getattr(self, name))
        model.train_function = model.test_function = None
        build_on_empty_batches(model)   # (a rank whose first batch has no rows)
        model._mpistrat_strategy = self.strategy
        if model.built and not self.per_rank_data:
            # weights made in the scope start alike on every rank (rank 0's); under Horovod
            # nothing is sent here (BroadcastGlobalVariablesCallback does it)
            mirror_weights(model, self.strategy)
            model._mpistrat_mirrored = True
        return model

    def share(self, x, y, sample_weight, batch_size, shuffle, what="fit"):
        """``(x, y, sample_weight, batch_size)`` as this rank hands them to Keras: NumPy
        arrays as a ``PyDataset`` of this rank's rebatch slices, ``ms`` datasets as a
        per-epoch data adapter, anything else as it is."""
        from mpistrat.data.dataset import Dataset
        from mpistrat.distribute.input_lib import DistributedDataset
        strategy, per_rank_data, world = self.strategy, self.per_rank_data, self.world
        if isinstance(x, Dataset) and not per_rank_data:   # as Keras under a TF strategy:
            x = strategy.experimental_distribute_dataset(x)   # batches of the global batch
        if isinstance(x, DistributedDataset):   # already this rank's share of each batch
            return _epochs_of(x), y, sample_weight, None
        if isinstance(x, Dataset):   # Horovod: each rank iterates its own dataset, the ranks
            return _own_epochs(strategy, x, what), y, sample_weight, None   # agreeing per batch
        if not _is_arrays(x):
            return x, y, sample_weight, batch_size
        arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        seed = getattr(self.model, "keras_shuffle_seed", 0)
        if per_rank_data:   # this rank's own rows, in batches of its own
            dataset = _RankShare(arrays, batch_size or 32, 0, 1, shuffle,
                                 seed * 65536 + world.rank)
            return dataset, None, None, None
        same_arrays_everywhere(strategy, arrays)
        dataset = _RankShare(arrays, batch_size or 32, world.rank, world.size, shuffle, seed)
        return dataset, None, None, None

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, **kwargs):
        from keras.utils import unpack_x_y_sample_weight
        model, strategy, per_rank_data = self.model, self.strategy, self.per_rank_data
        synchronized = self.synchronized
        if validation_split and validation_data is None:   # (Keras: validation_data wins)
            x, y, sample_weight, validation_data = _split_off(x, y, sample_weight,
                                                              validation_split)
        from mpistrat.data.dataset import Dataset
        from mpistrat.distribute.input_lib import DistributedDataset
        loss_rule(model, per_rank_data, synchronized)   # (what it refuses, before anything runs)
        if isinstance(validation_data, Dataset) and not per_rank_data:
            validation_data = strategy.experimental_distribute_dataset(validation_data)
        if isinstance(validation_data, DistributedDataset):   # (Keras: "Unrecognized data type")
            validation_data = _epochs_of(validation_data)
        elif isinstance(validation_data, Dataset):   # (per-rank data: this rank's own)
            validation_data = _own_epochs(strategy, validation_data, "fit (validation)")
        elif validation_data is not None and _is_arrays(validation_data):
            vx, vy, vw = unpack_x_y_sample_weight(validation_data)
            vbatch = kwargs.get("validation_batch_size") or batch_size
            validation_data = self.share(vx, vy, vw, vbatch, False)[0]
            kwargs.pop("validation_batch_size", None)
        x, y, sample_weight, batch_size = self.share(x, y, sample_weight, batch_size, shuffle)
        if per_rank_data:
            horovod = _horovod_reduction(model.optimizer)
            if horovod is not None:
                horovod.for_fit()   # (what fit refuses, before anything runs)
            x = agreed_batches(strategy, x, "fit")
            validation_data = agreed_batches(strategy, validation_data, "fit (validation)")
            same_steps_everywhere(strategy, x, kwargs.get("steps_per_epoch"), "fit")
            if validation_data is not None:
                same_steps_everywhere(strategy, validation_data,
                                      kwargs.get("validation_steps"), "validation")
        callbacks = for_fit(model, strategy, callbacks, mirror_weights, per_rank_data)
        with global_metrics():   # (its metrics hold the replicas' sums already)
            return self.cls.fit(model, x, y, batch_size=batch_size, epochs=epochs,
                                verbose=verbose, callbacks=callbacks,
                                validation_data=validation_data, shuffle=False,
                                class_weight=class_weight, sample_weight=sample_weight,
                                **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 **kwargs):
        model, cls = self.model, self.cls
        loss_rule(model, self.per_rank_data, self.synchronized)
        if kwargs.get("_use_cached_eval_dataset"):
            with global_metrics():
                return cls.evaluate(model, x, y, batch_size=batch_size, verbose=verbose,
                                    sample_weight=sample_weight, **kwargs)
        x, y, sample_weight, batch_size = self.share(x, y, sample_weight, batch_size, False,
                                                     "evaluate")
        if self.per_rank_data:
            x = agreed_batches(self.strategy, x, "evaluate")
            same_steps_everywhere(self.strategy, x, kwargs.get("steps"), "evaluate")
        with global_metrics():
            return cls.evaluate(model, x, y, batch_size=batch_size, verbose=verbose,
                                sample_weight=sample_weight, **kwargs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        import jax
        model, cls, world = self.model, self.cls, self.world
        if steps is not None or not _is_arrays(x) or self.per_rank_data:   # (not cut)
            return cls.predict(model, x, batch_size=batch_size, verbose=verbose, steps=steps,
                               callbacks=callbacks)
        from mpistrat.partition import even_ranges
        total = _rows(x)
        if total == 0:
            return cls.predict(model, x, batch_size=batch_size, verbose=verbose,
                               callbacks=callbacks)
        start, stop = even_ranges(total, world.size)[world.rank]
        block = jax.tree_util.tree_map(   # a rank without rows predicts one, then drops it
            lambda a: np.asarray(a)[start:stop] if stop > start else np.asarray(a)[:1], x)
        mine = cls.predict(model, block, batch_size=batch_size,
                           verbose=verbose if world.rank == 0 else 0, callbacks=callbacks)
        mine = jax.tree_util.tree_map(lambda p: np.asarray(p)[:stop - start], mine)
        engine = self.strategy.extended.engine
        return jax.tree_util.tree_map(np.asarray, engine.all_gather(mine, 0))
