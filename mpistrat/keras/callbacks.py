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
on every rank. Callbacks given on some ranks only (Horovod's "only on rank 0" pattern) run
where given, with no collective; a ``BackupAndRestore`` among them must be on rank 0, which
then gives every rank its restored epoch, weights and optimizer. Under ``mpistrat.horovod``
(each rank its own rows) nothing is mirrored when training starts: the ranks must start alike
or have ``hvd.callbacks.BroadcastGlobalVariablesCallback`` (else every rank raises, naming the
ranks that differ). The other callbacks run on every rank as given::

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
    from mpistrat.keras.adapter import initial_epoch, set_initial_epoch
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


def _broadcasts(callback) -> bool:
    return any(base.__name__ == "BroadcastGlobalVariablesCallback"
               for base in type(callback).__mro__)


def _weights_digest(model) -> str:
    import hashlib

    import numpy as np
    digest = hashlib.blake2b(digest_size=16)
    for variable in model.weights:
        value = np.ascontiguousarray(np.asarray(variable.value))
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def for_fit(model: Any, strategy: Any, callbacks: Optional[Sequence],
            mirror: Callable, per_rank_data: bool = False) -> List:
    """The callbacks ``fit`` runs: a first one that mirrors rank 0's weights when training
    starts (for a model built only by ``fit``), then the user's, file writers on rank 0.

    ``per_rank_data`` (``mpistrat.horovod``): nothing is mirrored; as in Horovod,
    ``hvd.callbacks.BroadcastGlobalVariablesCallback`` gives every rank its root's model and
    optimizer after the first batch. Ranks that start from different weights with no such
    callback on any rank raise a ``ValueError`` on every rank when training starts (Horovod
    would train their copies apart). A ``BackupAndRestore`` given on rank 0 only (Horovod's
    "only on rank 0" pattern) restores there, then rank 0's epoch, weights and optimizer are
    given to every rank; one given on other ranks but not on rank 0 is refused by name."""
    import keras
    from mpistrat.collectives.agreement import Failure, agree_errors
    from mpistrat.collectives.host_callbacks import settle
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

    class ShareRestored(keras.callbacks.Callback):
        """After the callbacks' ``on_train_begin`` (rank 0's own ``BackupAndRestore``
        restored there): rank 0's epoch, weights and optimizer on every rank."""

        def on_train_begin(self, logs=None):
            from mpistrat.keras.adapter import initial_epoch
            settle()   # (host callbacks' collectives first: these are MPI's own calls)
            if engine.broadcast_object(initial_epoch(model) is not None, 0):   # (restored)
                _share_restored(model, engine)

    class SameStart(keras.callbacks.Callback):
        """Per-rank data (Horovod): when training starts, after every other callback's
        ``on_train_begin``, the ranks hold the same weights, or some rank broadcasts them
        after the first batch (``BroadcastGlobalVariablesCallback``); else every rank
        raises, naming the ranks that differ from rank 0."""

        def on_train_begin(self, logs=None):
            from mpistrat.collectives.objects import allgather_object
            settle()
            views = allgather_object(engine, (any(_broadcasts(c) for c in given),
                                              _weights_digest(model)),
                                     "model.fit: the ranks' starting weights")
            if any(broadcasting for broadcasting, _ in views):
                return
            apart = [r for r, (_, digest) in enumerate(views) if digest != views[0][1]]
            if apart:
                raise ValueError(
                    f"model.fit with hvd.DistributedOptimizer: the ranks start from different "
                    f"weights (rank(s) {', '.join(map(str, apart))} differ from rank 0) and no "
                    f"rank has hvd.callbacks.BroadcastGlobalVariablesCallback, so each rank "
                    f"would train its own copy apart (Horovod does so silently). Add "
                    f"hvd.callbacks.BroadcastGlobalVariablesCallback(0) to the callbacks on "
                    f"every rank (after the first batch every rank takes rank 0's model and "
                    f"optimizer, as Horovod's), or build the model from the same seed on "
                    f"every rank (keras.utils.set_random_seed)")

    for name in _HOOKS:
        setattr(OnRankZero, name, delegate(name))
    given = [_without_tensorflow(c) for c in (callbacks or [])]
    for i, callback in enumerate(given):   # (MetricAverageCallback names them when logs differ)
        if getattr(type(callback), "_wants_callbacks_before", False):
            callback.callbacks_before = [type(c).__name__ for c in given[:i]]
    first = [] if per_rank_data else [Mirror()]
    last = [SameStart()] if per_rank_data else []
    writers = [type(c).__name__ for c in given if _writes_files(c)]
    restores = any(_restores(c) for c in given)
    settle()   # (a step's host callbacks still reducing go first: this is MPI's own allgather)
    views = engine.comm.allgather((writers, restores))
    if len({tuple(w) for w, _ in views}) > 1:
        # the ranks were given other file writers (Horovod's "only on rank 0" pattern): each
        # runs where it was given, with no collective that the other ranks would never join;
        # a BackupAndRestore there restores on rank 0, which then gives every rank its epoch,
        # weights and optimizer (else rank 0 would resume at a later epoch than the others)
        restoring = [r for r, (_, res) in enumerate(views) if res]
        if restoring and restoring[0] != 0:
            raise ValueError(
                f"model.fit: a BackupAndRestore is given on rank(s) "
                f"{', '.join(map(str, restoring))} but not on rank 0, so those ranks would "
                f"resume at another epoch than the others; give it on rank 0 (Horovod's "
                f"pattern: rank 0 restores and every rank takes its epoch, weights and "
                f"optimizer) or on every rank")
        shared = [ShareRestored()] if restoring else []
        return first + given + shared + last
    given = [OnRankZero(c) if _writes_files(c) else c for c in given]
    return first + given + last


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
