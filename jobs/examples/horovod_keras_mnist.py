"""Horovod's TensorFlow 2 Keras MNIST example, run on mpistrat.horovod (Keras 3 on JAX).

    scripts/mpirun -n 2 .venv/bin/python jobs/examples/horovod_keras_mnist.py --dir /tmp/hvd

Written anew from the steps of Horovod's ``examples/tensorflow2/tensorflow2_keras_mnist.py``:
initialise Horovod, pin a device by local rank, shard the data by rank, scale the learning
rate by the number of ranks, wrap the optimizer in ``hvd.DistributedOptimizer``, broadcast the
initial variables from rank 0, average the metrics, warm the learning rate up, write
checkpoints on rank 0 only, and print progress on rank 0 only.

Changes from the original:

* ``import mpistrat.horovod as hvd`` replaces ``import horovod.tensorflow.keras as hvd``;
  Keras 3 on JAX replaces ``tf.keras``; launch with ``mpirun -n N`` or ``srun``.
* The data: scikit-learn's bundled 8x8 digits (1797 images; 1500 to train, shared out as
  ``x[hvd.rank()::hvd.size()]``) stand in for MNIST's download (no network here).
* The checkpoint: ``ms.Checkpoint`` of the model and optimizer in ``--dir``, written by every
  rank together (one file that restores at any number of ranks) instead of Keras's
  ``ModelCheckpoint`` on rank 0; ``--resume`` restores it, at this run's width, and trains on.
* GPU pinning by ``hvd.local_rank()`` is left to mpistrat's device binding (one GPU per rank).
* Each rank prints a digest of its weights: every rank must print the same one.
"""

import argparse
import hashlib
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import mpistrat as ms  # noqa: E402
import mpistrat.horovod as hvd  # noqa: E402


def digest(model) -> str:
    h = hashlib.sha256()
    for variable in model.weights:
        h.update(np.ascontiguousarray(np.asarray(variable.value)).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by ranks)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="restore --dir's latest first")
    args = parser.parse_args()

    hvd.init()
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    x_mine, y_mine = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    keras.utils.set_random_seed(1234)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10, activation="softmax"),
    ])
    scaled_lr = 0.001 * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=optimizer,
                  metrics=["accuracy"])

    checkpoint = ms.Checkpoint(model=model, optimizer=model.optimizer)
    manager = ms.train.CheckpointManager(checkpoint, args.dir, max_to_keep=2)
    if args.resume:
        path = manager.restore_or_initialize()
        print(f"rank {hvd.rank()}: restored {path}, weights {digest(model)}", flush=True)

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if not args.resume:
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=2, verbose=1))
    model.fit(x_mine, y_mine, batch_size=32, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    saved = manager.save()
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"rank {hvd.rank()}: saved {saved}, weights {digest(model)}", flush=True)
    if hvd.rank() == 0:
        print(f"test loss {loss:.4f}, test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
