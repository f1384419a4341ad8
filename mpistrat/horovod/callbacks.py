"""Horovod's Keras callbacks (``hvd.callbacks``), for ``model.fit`` under ``mpistrat.horovod``.

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.004, warmup_epochs=3)]
"""

import math
import warnings
from typing import Any, Optional

import keras
import numpy as np

import mpistrat.horovod as hvd
from mpistrat.keras_adapter import reload_state

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, every rank takes rank ``root_rank``'s model and optimizer
    variables (so ranks that built their models apart, or restored on one rank, agree)."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        model = self.model
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
        hvd.broadcast_variables(variables, self.root_rank)
        reload_state(model)   # the next step reads the variables again


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, every numeric log is replaced by its average over the ranks
    (a no-op for models compiled with ``DistributedOptimizer``, whose logs are already global
    and the same on every rank)."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                       isinstance(np.asarray(v).item(), (int, float)))
        values = hvd.allreduce(np.array([float(logs[k]) for k in names], np.float64),
                               op=hvd.Average)
        for name, value in zip(names, np.asarray(values).tolist()):
            logs[name] = value


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Horovod's warm-up: over the first ``warmup_epochs`` the learning rate rises each batch
    from about ``initial_lr / size`` to ``initial_lr`` (``initial_lr / size * (e * (size - 1)
    / warmup_epochs + 1)`` with ``e = epoch + (batch + 1) / steps_per_epoch``), reaching
    ``initial_lr`` on the warm-up's last batch; after it the rate is left alone.

    ``momentum_correction`` is not applied (Keras 3 compiles an optimizer's momentum into its
    step): a warning says so when the optimizer has momentum."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__()
        self.initial_lr, self.warmup_epochs = float(initial_lr), warmup_epochs
        self.momentum_correction, self.steps_per_epoch = momentum_correction, steps_per_epoch
        self.verbose, self.epoch = verbose, 0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        momentum = getattr(self.model.optimizer, "momentum", 0) or 0
        if self.momentum_correction and momentum:
            warnings.warn("LearningRateWarmupCallback: momentum_correction is not applied "
                          "(Keras 3 compiles the momentum into the optimizer's step)",
                          RuntimeWarning, stacklevel=2)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback: pass steps_per_epoch (the number of "
                             "steps of an epoch is not known before it runs)")

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.epoch = epoch

    def learning_rate(self, epoch: float) -> float:
        """The learning rate at fractional epoch ``epoch`` (pure)."""
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        n = hvd.size()
        return self.initial_lr / n * (epoch * (n - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.epoch >= self.warmup_epochs:   # then the rate is the user's (schedules too)
            return
        # Horovod's: the rate of the batch about to run reaches initial_lr on the last
        # batch of the warm-up (epoch + (batch + 1) / steps)
        lr = self.learning_rate(self.epoch + (batch + 1) / self.steps_per_epoch)
        model = self.model
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()   # the running state back into the variables first
        model.optimizer.learning_rate = lr
        reload_state(model)   # the next step takes the new rate
        if self.verbose and hvd.rank() == 0 and batch == 0 and self.epoch < self.warmup_epochs:
            print(f"\nEpoch {self.epoch + 1}: learning rate {lr:.6g} (warm-up)")

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))
        if math.isclose(epoch + 1, self.warmup_epochs) and self.verbose and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished the learning-rate warm-up")
