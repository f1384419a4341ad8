"""Keras callbacks in ``fit`` under a strategy: the same weights on every rank when training
starts, and callbacks that write files writing once, from rank 0.

Every rank runs the same ``fit``, so a callback given to it runs on every rank.
``ModelCheckpoint``, ``BackupAndRestore`` and ``CSVLogger`` would then write the same file
from every rank at once (HDF5's lock refuses the second writer: ``unable to lock file, errno
= 11``; a CSV gets its lines several times). ``BackupAndRestore`` is restored by rank 0 (which
may repair a torn backup from the previous one), then rank 0's weights, optimizer state and
epoch are broadcast: the other ranks never read the backup, so a ``backup_dir`` on rank 0's
local disk works too. Keras's ``TensorBoard`` needs TensorFlow: it is swapped for
``ms.summary.TensorBoard``. ``for_fit`` hands Keras these callbacks wrapped so that they run on
rank 0 alone; every rank meets rank 0 at the end of each epoch and of training, so the
files are complete when ``fit`` returns anywhere, and a failure there (a full disk) raises
on every rank. The other callbacks run on every rank as given::

    model.fit(x, y, callbacks=[keras.callbacks.ModelCheckpoint("best.keras",
                                                               save_best_only=True)])
"""

from typing import Any, Callable, List, Optional, Sequence

__all__ = ["for_fit", "RANK_ZERO_CALLBACKS"]

RANK_ZERO_CALLBACKS = ("ModelCheckpoint", "CSVLogger",    # Keras callbacks that write files
                       "BackupAndRestore",               # (restored on every rank too)
                       "TensorBoardScalars")             # (ms.summary.TensorBoard)
_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_begin", "on_train_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
          "on_predict_batch_begin", "on_predict_batch_end")


def _share_restored(model, engine) -> None:
    """Rank 0's restored state on every rank: the epoch to resume at (Keras's
    ``_initial_epoch``, which ``BackupAndRestore`` sets), the model's variables and, when rank
    0's optimizer holds state, the optimizer's (built here first where it is not yet)."""
    import numpy as np
    from mpistrat.keras_adapter import initial_epoch, set_initial_epoch
    optimizer = getattr(model, "optimizer", None)
    epoch, built = engine.broadcast_object(
        (initial_epoch(model), bool(getattr(optimizer, "built", False))), 0)
    if engine.rank != 0:
        if epoch is not None:
            set_initial_epoch(model, epoch)
        if built and not optimizer.built:
            optimizer.build(model.trainable_variables)
    variables = list(model.variables) + (list(optimizer.variables) if built else [])
    values = engine.broadcast([np.asarray(v.value) for v in variables], 0)
    if engine.rank != 0:
        for variable, value in zip(variables, values):
            variable.assign(value)


def _restores(callback) -> bool:
    return any(base.__name__ == "BackupAndRestore" for base in type(callback).__mro__)


def _writes_files(callback) -> bool:
    return any(type(callback).__name__ == name or
               any(base.__name__ == name for base in type(callback).__mro__)
               for name in RANK_ZERO_CALLBACKS)


def for_fit(model: Any, strategy: Any, callbacks: Optional[Sequence],
            mirror: Callable) -> List:
    """The callbacks ``fit`` runs: a first one that mirrors rank 0's weights when training
    starts (for a model built only by ``fit``), then the user's, file writers on rank 0."""
    import keras
    from mpistrat.collectives.agreement import Failure, agree_errors
    engine, rank = strategy.extended.engine, strategy.extended.engine.rank

    class Mirror(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if not getattr(model, "_mpistrat_mirrored", False):
                mirror(model, strategy)
                model._mpistrat_mirrored = True

    class OnRankZero(keras.callbacks.Callback):
        """``inner`` on rank 0 alone; every rank meets at the end of training. A failure of
        ``inner`` (a full disk) is held and raised on every rank at the end of the epoch, so
        the others never wait in the next step for a rank 0 that left ``fit``."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.failure = inner, None

        def set_model(self, model_):
            super().set_model(model_)
            self.inner.set_model(model_)

        def set_params(self, params):
            super().set_params(params)
            self.inner.set_params(params)

    def run(self, name, args, kwargs, here):
        if here and self.failure is None:
            try:
                getattr(self.inner, name)(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - agreed below, raised on every rank
                self.failure = Failure(err, rank, f"{type(self.inner).__name__}.{name}")

    def delegate(name):
        def hook(self, *args, **kwargs):
            what = f"a callback that runs on rank 0 ({type(self.inner).__name__})"
            run(self, name, args, kwargs, rank == 0)
            if name == "on_train_begin" and _restores(self.inner):
                # BackupAndRestore: rank 0 loads the backup (repairing a torn one from the
                # previous, as Keras does), then gives every rank its weights, optimizer
                # state and epoch: the others never read the files (a backup_dir on rank
                # 0's local disk works, and no rank but 0 ever writes there)
                agree_errors(engine, self.failure, what)
                _share_restored(self.inner.model, engine)
            if name in ("on_epoch_end", "on_train_end"):   # (every rank: the files are
                agree_errors(engine, self.failure, what)     # complete, or all raise)
        return hook

    for name in _HOOKS:
        setattr(OnRankZero, name, delegate(name))
    given = [_without_tensorflow(c) for c in (callbacks or [])]
    writers = [type(c).__name__ for c in given if _writes_files(c)]
    if len({tuple(w) for w in [writers] + engine.comm.allgather(writers)}) > 1:
        # the ranks were given other file writers (Horovod's "only on rank 0" pattern): each
        # runs where it was given, with no collective that the other ranks would never join
        return [Mirror()] + given
    given = [OnRankZero(c) if _writes_files(c) else c for c in given]
    return [Mirror()] + given


def _without_tensorflow(callback: Any) -> Any:
    """Keras's ``TensorBoard`` needs TensorFlow to write: swapped for ``ms.summary``'s, which
    writes the same scalar tags (histograms, images and graphs are not written: warned)."""
    if type(callback).__name__ != "TensorBoard" or \
            not type(callback).__module__.startswith("keras"):
        return callback
    import warnings
    from mpistrat.summary import TensorBoard
    if getattr(callback, "histogram_freq", 0) or getattr(callback, "write_images", False) or \
            getattr(callback, "embeddings_freq", 0):
        warnings.warn("keras.callbacks.TensorBoard under mpistrat writes scalars only "
                      "(histograms, images and embeddings need TensorFlow)", RuntimeWarning,
                      stacklevel=3)
    return TensorBoard(callback.log_dir, update_freq=callback.update_freq)
