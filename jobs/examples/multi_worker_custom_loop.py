"""TensorFlow's tutorial "Multi-worker training with a custom training loop", on mpistrat.

    scripts/mpirun -n 3 .venv/bin/python jobs/examples/multi_worker_custom_loop.py --short

Every rank is one worker of a ``MultiWorkerMirroredStrategy``; each builds its own input
pipeline with ``distribute_datasets_from_function`` (its shard of the data, batched per
replica), computes the loss of its share of the global batch, and the gradients are summed
over the workers before the optimizer applies them. The epoch and the step within it are
variables saved with the model and the optimizer, so a job restarted with the same
``--checkpoint-dir`` (at any number of ranks) continues at the epoch it reached.

Changes from the original
(https://www.tensorflow.org/tutorials/distribute/multi_worker_with_ctl):

* ``import mpistrat as ms`` for ``tf.distribute``/``tf.train``/``tf.nn``; launch with
  ``mpirun -n N`` or ``srun`` instead of one ``TF_CONFIG`` per worker (the cluster comes
  from MPI: ``strategy.cluster_resolver.task_type`` / ``task_id`` are still there).
* The model is the same Keras network (Reshape, Conv2D 32x3 relu, Flatten, Dense 128 relu,
  Dense 10) on Keras 3's JAX backend; ``tf.GradientTape`` and ``tf.function`` become the
  stateless JAX step of Keras 3 (``model.stateless_call``, ``jax.value_and_grad``,
  ``optimizer.stateless_apply`` under ``jax.jit``). TensorFlow's optimizer sums the replicas'
  gradients inside ``apply_gradients``; here ``ms.nn.all_reduce_gradients(grads, strategy,
  "SUM")`` does it inside the step. Every rank seeds Keras alike, so the replicas start equal.
* ``tf.keras.metrics.SparseCategoricalAccuracy`` becomes a count of correct predictions
  reduced with ``strategy.reduce``.
* No ``write_filepath`` / ``workertemp_N`` directories: all ranks write one checkpoint
  together into ``--checkpoint-dir`` (the chief-only writing and the deletion of the other
  workers' copies are not needed; ranks passing different directories get an error naming
  each rank's path).
* The data: the original downloads MNIST; here, without network access, a seeded synthetic
  stand-in of the same shapes is used (``--data FILE.npz`` with ``x_train, y_train`` takes the
  real one). The shuffle is seeded with the run's seed plus the epoch (the original leaves it
  unseeded; ours would agree one seed across ranks anyway), so that a resumed run sees the
  epochs an uninterrupted one would, and runs at different widths see the same global batches.
* The epoch counter is advanced before the save (the original saves first), so a restored
  run never meets an epoch whose steps are all done.
* ``--global-batch`` (default 64 per replica) fixes the global batch; ``--short``: 600 rows,
  10 steps per epoch, for tests.
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")   # before Keras is imported

import numpy as np  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402

import mpistrat as ms  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=70)
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--data", default=None, help="an .npz with the real MNIST")
    parser.add_argument("--short", action="store_true", help="a short run (tests)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def mnist_arrays(args):
    """MNIST's training images in [0, 1] (float32, 28x28) and labels (int64)."""
    if args.data:
        with np.load(args.data) as f:
            return f["x_train"] / np.float32(255), f["y_train"].astype(np.int64)
    rng = np.random.default_rng(args.seed)
    count = 600 if args.short else 60000
    templates = rng.uniform(0, 1, size=(10, 28, 28))
    labels = rng.integers(0, 10, size=count)
    images = np.clip(templates[labels] + rng.normal(0, 0.3, (count, 28, 28)), 0, 1)
    return images.astype(np.float32), labels.astype(np.int64)


def build_cnn_model():
    return keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.short:
        args.steps_per_epoch = min(args.steps_per_epoch, 10)
    strategy = ms.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    is_chief = resolver.task_type in (None, "chief") or \
        (resolver.task_type == "worker" and resolver.task_id == 0)
    say = print if is_chief else (lambda *a, **k: None)
    global_batch = args.global_batch or args.batch_per_replica * strategy.num_replicas_in_sync
    x_train, y_train = mnist_arrays(args)

    def dataset_fn(input_context, epoch):
        batch_size = input_context.get_per_replica_batch_size(global_batch)
        dataset = ms.data.Dataset.from_tensor_slices((x_train, y_train)) \
            .shuffle(len(x_train), seed=args.seed + epoch)
        dataset = dataset.shard(input_context.num_input_pipelines,
                                input_context.input_pipeline_id)
        return dataset.batch(batch_size)

    with strategy.scope():
        keras.utils.set_random_seed(args.seed)       # the same initial model on every rank
        model = build_cnn_model()
        optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
        optimizer.build(model.trainable_variables)
        epoch = ms.Variable(np.int64(0), name="epoch")
        step_in_epoch = ms.Variable(np.int64(0), name="step_in_epoch")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        loss = ms.nn.compute_average_loss(loss_fn(y, logits), global_batch_size=global_batch)
        return loss, (logits, non_trainable)

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def step_fn(state, x, y):
        trainable, non_trainable, optimizer_vars = state
        (loss, (logits, non_trainable)), grads = grad_fn(trainable, non_trainable, x, y)
        grads = ms.nn.all_reduce_gradients(grads, strategy, "SUM")
        trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        return loss, (logits.argmax(-1) == y).sum(), (trainable, non_trainable, optimizer_vars)

    def state_of_model():
        return ([v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                [v.value for v in optimizer.variables])

    def write_back(state):
        variables = (model.trainable_variables, model.non_trainable_variables,
                     optimizer.variables)
        for group, values in zip(variables, state):
            for variable, value in zip(group, values):
                variable.assign(value)

    checkpoint_dir = args.checkpoint_dir or strategy.extended.engine.broadcast_object(
        tempfile.mkdtemp(prefix="multi_worker_ctl-") if is_chief else None)
    checkpoint = ms.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch,
                                     step_in_epoch=step_in_epoch)
    manager = ms.train.CheckpointManager(checkpoint, directory=checkpoint_dir, max_to_keep=1)
    latest = ms.train.latest_checkpoint(checkpoint_dir)
    if latest:
        checkpoint.restore(latest).assert_consumed()
        say(f"Restored {latest}: epoch {int(epoch.numpy())}, "
            f"step_in_epoch {int(step_in_epoch.numpy())}")
    state = state_of_model()

    def train_step(inputs):
        nonlocal state
        x, y = inputs
        loss, correct, state = step_fn(state, x, y)
        return np.float32(loss), np.int64(correct), np.int64(len(y))

    while int(epoch.numpy()) < args.epochs:
        dataset = strategy.distribute_datasets_from_function(
            lambda context: dataset_fn(context, int(epoch.numpy())))
        iterator = iter(dataset)
        total_loss, num_batches, correct, rows = 0.0, 0, 0, 0
        while int(step_in_epoch.numpy()) < args.steps_per_epoch:
            loss, right, count = strategy.run(train_step, args=(next(iterator),))
            total_loss += float(strategy.reduce("SUM", loss, axis=None))
            correct += int(strategy.reduce("SUM", right, axis=None))
            rows += int(strategy.reduce("SUM", count, axis=None))
            num_batches += 1
            step_in_epoch.assign_add(1)
        say(f"Epoch: {int(epoch.numpy())}, accuracy: {correct / rows:.6f}, "
            f"train_loss: {total_loss / num_batches:.6f}.")
        write_back(state)                      # the model's variables hold the trained values
        epoch.assign_add(1)
        step_in_epoch.assign(0)
        manager.save()                         # every rank: one checkpoint, written together
    say(f"Checkpoints in {checkpoint_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
