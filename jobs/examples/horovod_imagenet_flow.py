"""The flow of Horovod's Keras ImageNet ResNet-50 example, run on mpistrat.horovod (Keras 3 on
JAX), on a tiny synthetic image set so that an epoch takes seconds on a CPU.

    scripts/mpirun -n 2 .venv/bin/python jobs/examples/horovod_imagenet_flow.py --epochs 3 --dir DIR

Written anew from the steps of Horovod's ``examples/keras/keras_imagenet_resnet50.py``:

* the epoch to resume from is found on rank 0 (the newest ``checkpoint-{epoch}.keras`` in
  ``--dir``) and broadcast (``hvd.broadcast(resume_from_epoch, 0)``), so every rank starts at it;
* rank 0 resumes with ``hvd.load_model`` (the optimizer wrapped in ``DistributedOptimizer``,
  its state restored); the other ranks build and compile afresh, and
  ``BroadcastGlobalVariablesCallback(0)`` gives them rank 0's model and optimizer after the
  first batch;
* the learning rate: ``base_lr * hvd.size()``, warmed up over ``--warmup-epochs`` epochs
  (``LearningRateWarmupCallback``) then stepped down by 10 at each epoch of ``--schedule``
  (``LearningRateScheduleCallback``; Horovod's 30/60/80 of 90 epochs, scaled down to 3/4/5;
  the multipliers are given as functions, ``lambda epoch: 1e-1``: a number means the
  exponential ``multiplier ** (epoch - start_epoch)`` in Horovod's callback, 1 at its start);
  SGD with momentum 0.9, as there;
* ``MetricAverageCallback`` averages the metrics; ``keras.callbacks.ModelCheckpoint`` and the
  metrics log are given on rank 0 only (Horovod's pattern). The metrics log is Keras's
  ``TensorBoard`` callback, which mpistrat swaps for ``ms.summary``'s writer (scalars, no
  TensorFlow needed), and a ``CSVLogger`` beside it (a log the test can read);
* each rank takes its own rows (``x[hvd.rank()::hvd.size()]``) and makes
  ``steps_per_epoch = rows // size // batch`` steps, as Horovod's example divides the steps.

Changes from the original: ``import mpistrat.horovod as hvd``; 64 random 8x8x3 images of 4
classes and a tiny conv net replace ImageNet and ResNet-50; no data augmentation; the
checkpoints are ``.keras`` files (Keras 3) instead of ``.h5``. Each rank prints the epoch it
resumes from, the learning rate each epoch ended with, and a digest of its final weights.
"""

import argparse
import glob
import hashlib
import os
import re

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import mpistrat.horovod as hvd  # noqa: E402

CHECKPOINT = "checkpoint-{epoch}.keras"


def digest(model) -> str:
    h = hashlib.sha256()
    for variable in model.weights:
        h.update(np.ascontiguousarray(np.asarray(variable.value)).tobytes())
    return h.hexdigest()[:16]


def synthetic_images(count, seed):
    """``count`` random 8x8x3 images; the class is the brightest of four quadrants."""
    rng = np.random.default_rng(seed)
    x = rng.random((count, 8, 8, 3)).astype("float32")
    quadrants = np.stack([x[:, :4, :4].mean((1, 2, 3)), x[:, :4, 4:].mean((1, 2, 3)),
                          x[:, 4:, :4].mean((1, 2, 3)), x[:, 4:, 4:].mean((1, 2, 3))], 1)
    return x, quadrants.argmax(1).astype("int64")


def build(base_lr):
    keras.utils.set_random_seed(hvd.rank())   # (apart on purpose: rank 0's is broadcast)
    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(4, activation="softmax"),
    ])
    optimizer = keras.optimizers.SGD(base_lr * hvd.size(), momentum=0.9)
    model.compile(loss="sparse_categorical_crossentropy",
                  optimizer=hvd.DistributedOptimizer(optimizer), metrics=["accuracy"])
    return model


class PrintRate(keras.callbacks.Callback):
    """Every rank prints the rate its epoch ended with."""

    def on_epoch_end(self, epoch, logs=None):
        rate = float(np.asarray(self.model.optimizer.learning_rate))
        print(f"rank {hvd.rank()}: epoch {epoch} lr {rate:.8g}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="checkpoints and logs (rank 0 writes)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--base-lr", type=float, default=0.0125)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--schedule", default="3,4,5",
                        help="epochs at which the rate is divided by 10 (Horovod's 30,60,80)")
    args = parser.parse_args()

    hvd.init()
    os.makedirs(args.dir, exist_ok=True)
    checkpoint_format = os.path.join(args.dir, CHECKPOINT)

    # the newest checkpoint, found on rank 0 and broadcast: every rank resumes at that epoch
    resume_from_epoch = 0
    if hvd.rank() == 0:
        for path in glob.glob(os.path.join(args.dir, "checkpoint-*.keras")):
            resume_from_epoch = max(resume_from_epoch,
                                    int(re.search(r"checkpoint-(\d+)\.keras$", path).group(1)))
    resume_from_epoch = int(hvd.broadcast(np.int64(resume_from_epoch), 0,
                                          name="resume_from_epoch"))
    print(f"rank {hvd.rank()}: resuming from epoch {resume_from_epoch}", flush=True)

    x, y = synthetic_images(64, seed=7)
    x_val, y_val = synthetic_images(16, seed=8)
    x_mine, y_mine = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    xv_mine, yv_mine = x_val[hvd.rank()::hvd.size()], y_val[hvd.rank()::hvd.size()]
    steps_per_epoch = len(x) // hvd.size() // args.batch_size
    validation_steps = max(1, len(x_val) // hvd.size() // args.batch_size)

    if resume_from_epoch > 0 and hvd.rank() == 0:
        model = hvd.load_model(checkpoint_format.format(epoch=resume_from_epoch))
    else:
        model = build(args.base_lr)

    scaled_lr = args.base_lr * hvd.size()
    first, second, third = (int(e) for e in args.schedule.split(","))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
        hvd.callbacks.LearningRateScheduleCallback(scaled_lr, multiplier=1.0,
                                                   start_epoch=args.warmup_epochs,
                                                   end_epoch=first),
        hvd.callbacks.LearningRateScheduleCallback(scaled_lr, multiplier=lambda epoch: 1e-1,
                                                   start_epoch=first, end_epoch=second),
        hvd.callbacks.LearningRateScheduleCallback(scaled_lr, multiplier=lambda epoch: 1e-2,
                                                   start_epoch=second, end_epoch=third),
        hvd.callbacks.LearningRateScheduleCallback(scaled_lr, multiplier=lambda epoch: 1e-3,
                                                   start_epoch=third),
        PrintRate(),
    ]
    if hvd.rank() == 0:   # checkpoints and logs on rank 0 only, after the averaging
        print(f"rank {hvd.rank()}: checkpointing to {args.dir}", flush=True)
        callbacks += [keras.callbacks.ModelCheckpoint(checkpoint_format),
                      keras.callbacks.TensorBoard(os.path.join(args.dir, "logs")),
                      keras.callbacks.CSVLogger(os.path.join(args.dir, "metrics.csv"),
                                                append=resume_from_epoch > 0)]

    model.fit(x_mine, y_mine, batch_size=args.batch_size, steps_per_epoch=steps_per_epoch,
              epochs=args.epochs, initial_epoch=resume_from_epoch, callbacks=callbacks,
              validation_data=(xv_mine, yv_mine), validation_steps=validation_steps,
              verbose=2 if hvd.rank() == 0 else 0)

    score = model.evaluate(xv_mine, yv_mine, batch_size=args.batch_size, verbose=0)
    print(f"rank {hvd.rank()}: done at epoch {args.epochs}, weights {digest(model)}, "
          f"validation loss {score[0]:.4f}", flush=True)


if __name__ == "__main__":
    main()
