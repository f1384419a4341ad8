"""Horovod's Keras callbacks (``hvd.callbacks``), for ``model.fit`` under ``mpistrat.horovod``.

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.004, warmup_epochs=3),
                 hvd.callbacks.LearningRateScheduleCallback(0.004, multiplier=0.1,
                                                            start_epoch=30, end_epoch=60)]

The learning-rate callbacks set the rate Horovod's do, batch by batch, in the optimizer's
``learning_rate`` variable (Keras 3), and apply Horovod's momentum correction.
"""

from typing import Callable, Optional, Union

import keras
import numpy as np

import mpistrat.horovod as hvd
from mpistrat.keras.adapter import momentum_slots, reload_state

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """After the first batch of training, every rank takes rank ``root_rank``'s model and
    optimizer variables (so ranks that built their models apart, or restored on one rank,
    agree), as Horovod's: the first batch runs on each rank's own weights, its gradients are
    averaged and applied on every rank, then the root's model and optimizer (built by then
    on every rank, so a rank that loaded a file with optimizer slots and ranks that start
    afresh send the same variables) replace every other rank's. Once per callback object,
    as Horovod's ``broadcast_done``."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.broadcast_done:
            return
        model = self.model
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables) + (list(optimizer.variables) if optimizer else [])
        hvd.broadcast_variables(variables, self.root_rank)
        reload_state(model)   # the next step reads the variables again
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, every numeric log is replaced by its average over the ranks
    (a no-op for models compiled with ``DistributedOptimizer``, whose logs are already global
    and the same on every rank). The ranks first agree on the logs' keys: a callback that runs
    on some ranks only and adds logs before this one (listed ahead of it) makes every rank
    raise a ``ValueError`` naming each rank's keys and the callbacks given on some ranks
    only, instead of a reduction of tensors of different shapes."""

    _wants_callbacks_before = True   # (set by fit: the callbacks listed ahead of this one)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        logs = {} if logs is None else logs
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                       isinstance(np.asarray(v).item(), (int, float)))
        before = list(getattr(self, "callbacks_before", ()))
        everyone = hvd.allgather_object((names, before),
                                        name="MetricAverageCallback: the logs' keys")
        if any(keys != names for keys, _ in everyone):
            _logs_differ(epoch, everyone)
        if not names:
            return
        values = hvd.allreduce(np.array([float(logs[k]) for k in names], np.float64),
                               op=hvd.Average)
        for name, value in zip(names, np.asarray(values).tolist()):
            logs[name] = value


def _logs_differ(epoch: int, everyone: list) -> None:
    per_rank = "; ".join(f"rank {r}: {keys}" for r, (keys, _) in enumerate(everyone))
    common = set.intersection(*(set(keys) for keys, _ in everyone))
    extra = sorted({k for keys, _ in everyone for k in keys} - common)
    counts: dict = {}
    for _, before in everyone:
        for name in set(before):
            counts[name] = counts.get(name, 0) + 1
    some = sorted(name for name, n in counts.items() if n < len(everyone))
    if some:
        where = {name: [r for r, (_, b) in enumerate(everyone) if name in b] for name in some}
        culprit = "; ".join(f"{name} (on rank(s) {', '.join(map(str, ranks))} only)"
                            for name, ranks in where.items())
        cause = f"the callback(s) listed ahead of MetricAverageCallback on some ranks only: " \
                f"{culprit}"
    else:
        cause = "a callback that runs on some ranks only, listed ahead of " \
                "MetricAverageCallback, or a model whose logs differ between the ranks"
    raise ValueError(
        f"hvd.callbacks.MetricAverageCallback at the end of epoch {epoch}: the ranks' logs "
        f"have different keys ({per_rank}; on some ranks only: {extra}), so their averages "
        f"cannot be taken. The likely cause is {cause}. List such a callback after "
        f"MetricAverageCallback (Horovod's examples put rank-0-only callbacks last), or give it "
        f"on every rank")


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's learning-rate schedule: from epoch ``start_epoch`` up to (not including)
    ``end_epoch`` (``None``: no end) the rate is ``initial_lr * multiplier(epoch)``; outside
    that range the rate is left alone. A number ``multiplier`` means the exponential
    ``multiplier ** (epoch - start_epoch)``.

    ``staircase=True`` sets the rate at the first batch of each epoch, ``epoch`` the epoch's
    number; ``staircase=False`` sets it at every batch, ``epoch`` then ``e + b /
    steps_per_epoch`` for batch ``b`` of epoch ``e`` (``steps_per_epoch``: found from ``fit``
    when not given; ``ValueError`` when ``fit`` does not know it). At each epoch's end the
    rate is logged as ``lr``.

    ``momentum_correction`` (Horovod's default, for an optimizer with a ``momentum``, behind
    Keras's ``LossScaleOptimizer`` too): the batch whose rate changes from ``old`` to ``new``
    runs as if the momentum were ``momentum * new / old``, as Horovod sets it for that batch.
    Keras 3 compiles the momentum into its step, so the same update is made otherwise: the
    momentum buffers are scaled by ``new / old`` before the step (exact for ``SGD`` and
    ``RMSprop``), and for Nesterov ``SGD`` the step's weights are corrected after it. Other
    optimizers with a ``momentum`` raise ``hvd.NotSupportedError`` at the start of training
    (pass ``momentum_correction=False``); no correction when ``old`` is 0 (Horovod divides by
    it) or the momentum is 0."""

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{type(self).__name__}: initial_lr is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = multiplier
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.current_epoch: Optional[int] = None
        self._momentum: Optional[tuple] = None   # (optimizer, kind, momentum) to correct
        self._after_step: Optional[float] = None   # Nesterov: the weights' correction

    def learning_rate(self, epoch: float) -> float:
        """The rate set when the schedule's epoch is ``epoch`` (pure): ``initial_lr *
        multiplier(epoch)``."""
        return self.initial_lr * self.multiplier(epoch)

    def _steps(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"{type(self).__name__}: the number of steps of an epoch is not known "
                         f"before it runs; pass steps_per_epoch=...")

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._steps()
        self._momentum = self._momentum_to_correct() if self.momentum_correction else None

    def _momentum_to_correct(self) -> Optional[tuple]:
        optimizer = self.model.optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)   # (LossScaleOptimizer)
        if not hasattr(inner, "momentum"):
            return None                       # Horovod: no momentum, nothing to correct
        momentum = float(inner.momentum)
        if momentum == 0:
            return None                       # (0 times any ratio is 0)
        name = type(self).__name__
        if isinstance(inner, keras.optimizers.SGD):
            kind = "nesterov" if inner.nesterov else "sgd"
        elif isinstance(inner, keras.optimizers.RMSprop):
            kind = "rmsprop"
        else:
            raise hvd.NotSupportedError(
                f"{name}: momentum_correction for {type(inner).__name__} is not supported "
                f"(it is applied to SGD and RMSprop); pass momentum_correction=False")
        if getattr(inner, "gradient_accumulation_steps", None):
            raise hvd.NotSupportedError(
                f"{name}: momentum_correction with gradient_accumulation_steps is not "
                f"supported (the step that uses the momentum is not the batch whose rate "
                f"changes); pass momentum_correction=False")
        return inner, kind, momentum

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_rate(epoch)
        else:
            self._set_rate(epoch + float(batch) / self.steps_per_epoch)

    def _set_rate(self, epoch: float) -> None:
        model = self.model
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()   # the running state back into the variables first
        optimizer = model.optimizer
        old = float(np.asarray(optimizer.learning_rate))
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        if self._momentum is not None and old != 0 and new != old:
            self._scale_momentum(new / old)
        reload_state(model)   # the next step takes the new rate (and buffers)

    def _scale_momentum(self, ratio: float) -> None:
        """Horovod's ``momentum * ratio`` for one step, made on the momentum buffers: a
        buffer ``v`` enters the step as ``momentum * v`` in SGD and RMSprop, so ``ratio * v``
        gives the same update and the same new buffer."""
        inner, kind, momentum = self._momentum
        for _, buffer in momentum_slots(inner):
            buffer.assign(buffer.value * np.asarray(ratio, buffer.dtype))
        if kind == "nesterov":   # Nesterov adds momentum * v' to the weights too
            self._after_step = momentum * (ratio - 1.0)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._after_step is None:
            return
        coefficient, self._after_step = self._after_step, None
        model = self.model
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()
        for variable, buffer in momentum_slots(self._momentum[0]):
            variable.assign(variable.value + buffer.value * np.asarray(coefficient,
                                                                       buffer.dtype))
        reload_state(model)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warm-up: over the first ``warmup_epochs`` the rate rises each batch from about
    ``initial_lr / size`` to ``initial_lr``; after it the rate is left alone. Batch ``b`` of
    epoch ``e`` runs at ``initial_lr * (1 / size * ((e + b / steps + 1 / steps) * (size - 1) /
    warmup_epochs + 1))`` (Horovod's schedule, ``staircase=False``, with its shift of one
    batch), so the warm-up's last batch runs at ``initial_lr``. Momentum correction as
    ``LearningRateScheduleCallback``'s. ``verbose``: rank 0 says when the warm-up ends."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__(initial_lr, self._warmup, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def _warmup(self, epoch: float) -> float:
        shifted = epoch + 1.0 / self.steps_per_epoch   # (the batch's end, not its start)
        n = hvd.size()
        return 1.0 / n * (shifted * (n - 1) / self.warmup_epochs + 1)

    def learning_rate(self, epoch: float) -> float:
        """Horovod's warm-up curve at fractional epoch ``epoch``: ``initial_lr / size *
        (epoch * (size - 1) / warmup_epochs + 1)`` (pure); batch ``b`` of epoch ``e`` runs at
        its value at ``e + (b + 1) / steps_per_epoch``."""
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        n = hvd.size()
        return self.initial_lr / n * (epoch * (n - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.verbose > 0 and epoch == self.end_epoch - 1 and hvd.rank() == 0:
            rate = float(np.asarray(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: learning-rate warm-up done, the rate is now {rate:g}")
