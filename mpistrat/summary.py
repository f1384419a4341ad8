"""TensorBoard's event files without TensorFlow: scalars, as ``simple_value`` summaries.

An event file is a TFRecord file of ``Event`` messages: first ``file_version
"brain.Event:2"``, then one event per scalar (wall time, step, ``Summary`` of one value with its
tag and ``simple_value``), named ``events.out.tfevents.TIME.HOST.PID.N`` in its log directory,
so ``tensorboard --logdir`` shows it as a TensorFlow job's::

    >>> import tempfile, mpistrat as ms
    >>> writer = ms.summary.create_file_writer(tempfile.mkdtemp())
    >>> writer.scalar("loss", 0.25, step=3)
    >>> writer.close()

``TensorBoard(log_dir)`` is the Keras callback (Keras's own needs TensorFlow): on rank 0 it
writes each epoch's logs to ``log_dir/train`` and ``log_dir/validation`` (``val_`` keys) as
``epoch_<name>``, and with ``update_freq=N`` every N-th batch's as ``batch_<name>``, the tags
Keras's callback writes. Under a strategy, ``fit`` swaps a ``keras.callbacks.TensorBoard`` it
is given for this one (the same ``log_dir`` and ``update_freq``).
"""

import itertools
import os
import socket
import time
from typing import Any, Optional

import numpy as np

from mpistrat.io.records import TFRecordWriter
from mpistrat.tfformats import messages

__all__ = ["EventFileWriter", "create_file_writer", "TensorBoard"]

_COUNTER = itertools.count()


class EventFileWriter:
    """Scalars into a new event file in ``logdir`` (made if missing)."""

    def __init__(self, logdir: str, filename_suffix: str = ""):
        os.makedirs(logdir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_COUNTER)}{filename_suffix}")
        self.path = os.path.join(logdir, name)
        self._records = TFRecordWriter(self.path)
        self._write({"wall_time": time.time(), "file_version": "brain.Event:2"})

    def _write(self, event: dict) -> None:
        self._records.write(messages.serialize("Event", event))

    def scalar(self, tag: str, value: Any, step: int) -> None:
        """Append ``value`` (a number) under ``tag`` at ``step``; NaN and inf are written."""
        number = float(np.float32(float(value)))   # as stored: beyond float32's range, inf
        self._write({"wall_time": time.time(), "step": int(step),
                     "summary": {"value": [{"tag": str(tag), "simple_value": number}]}})

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()


def create_file_writer(logdir: str, filename_suffix: str = "") -> EventFileWriter:
    """``tf.summary.create_file_writer``'s counterpart for scalars (call it on one rank)."""
    return EventFileWriter(logdir, filename_suffix)


def _numbers(logs: Optional[dict]):
    for key, value in sorted((logs or {}).items()):
        try:
            number = float(value)
        except (TypeError, ValueError):   # (not one number)
            continue
        yield key, number


class TensorBoard:
    """Keras callback writing the logs of ``fit`` as TensorBoard scalars, from rank 0."""

    def __new__(cls, log_dir: str = "logs", update_freq: Any = "epoch", **ignored: Any):
        import keras

        class TensorBoardScalars(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.log_dir = os.fspath(log_dir)
                self.update_freq = 1 if update_freq == "batch" else update_freq
                self.writers: dict = {}
                self.batches = 0
                from mpistrat.runtime import get_world
                self.writes = get_world().rank == 0

            def _writer(self, kind: str) -> EventFileWriter:
                if kind not in self.writers:
                    self.writers[kind] = EventFileWriter(os.path.join(self.log_dir, kind))
                return self.writers[kind]

            def on_train_batch_end(self, batch, logs=None):
                self.batches += 1
                if self.writes and isinstance(self.update_freq, int) and \
                        self.batches % self.update_freq == 0:
                    for key, value in _numbers(logs):
                        self._writer("train").scalar(f"batch_{key}", value, self.batches)

            def on_epoch_end(self, epoch, logs=None):
                if not self.writes:
                    return
                for key, value in _numbers(logs):
                    kind, name = ("validation", key[4:]) if key.startswith("val_") else \
                        ("train", key)
                    self._writer(kind).scalar(f"epoch_{name}", value, epoch)
                for writer in self.writers.values():
                    writer.flush()

            def on_train_end(self, logs=None):
                for writer in self.writers.values():
                    writer.close()
                self.writers = {}

        return TensorBoardScalars()
