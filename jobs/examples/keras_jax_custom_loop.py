"""Keras 3's guide "Writing a training loop from scratch in JAX", data parallel with mpistrat.

    scripts/mpirun -n 2 .venv/bin/python jobs/examples/keras_jax_custom_loop.py --short

A Keras 3 model (JAX backend) is trained by a jitted, stateless step: ``model.stateless_call``
for the forward pass, ``jax.value_and_grad`` for gradients, ``optimizer.stateless_apply`` for
the update. Each rank trains on its share of every global batch.

Changes from the original
(https://keras.io/guides/writing_a_custom_training_loop_in_jax/):

* ``import mpistrat as ms``; a ``MultiWorkerMirroredStrategy`` (one replica per rank) and
  ``strategy.experimental_distribute_dataset`` over an ``ms.data`` pipeline replace the
  single-process ``tf.data`` pipeline; launch with ``mpirun -n N``.
* The loss is per example (``reduction=None``) and scaled by ``ms.nn.compute_average_loss``
  over the **global** batch; inside the jitted step ``ms.nn.all_reduce_gradients(grads,
  strategy, "SUM")`` sums the replicas' gradients before ``optimizer.stateless_apply``, so
  every rank applies the same update and the model is the one a single process would train on
  the global batch. (The original averages its own batch and needs no aggregation.)
* Every rank builds the model from the same seed (``keras.utils.set_random_seed``), so the
  replicas start equal.
* The data: the original downloads MNIST (``keras.datasets.mnist``); here, without network
  access, a seeded synthetic stand-in of the same shapes (784 float32 features, labels 0-9)
  is used; ``--data FILE.npz`` (``x_train, y_train, x_test, y_test``) takes the real one.
  Labels stay integers (``SparseCategoricalCrossentropy``).
* Accuracy: the original updates a ``keras.metrics`` object statelessly per batch; here each
  replica counts its correct predictions and ``strategy.reduce("SUM", ...)`` combines them.
* ``--global-batch`` (default 32 per replica x replicas) fixes the global batch so that runs at
  different widths give the same losses (the launcher test compares 1 and 2 ranks);
  ``--short``: a few hundred rows and 2 epochs, for tests.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")   # before Keras is imported

import numpy as np  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402

import mpistrat as ms  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--data", default=None, help="an .npz with the real MNIST")
    parser.add_argument("--short", action="store_true", help="a short run (tests)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def synthetic_mnist(train: int, test: int, seed: int):
    """Ten 784-pixel class templates plus noise, in [0, 1]: MNIST's shapes and dtypes."""
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0, 1, size=(10, 784))

    def make(count):
        labels = rng.integers(0, 10, size=count)
        images = np.clip(templates[labels] + rng.normal(0, 0.3, (count, 784)), 0, 1)
        return images.astype(np.float32), labels.astype(np.int32)

    return make(train), make(test)


def load(args):
    if args.data:
        with np.load(args.data) as f:
            x_train = f["x_train"].reshape(-1, 784).astype(np.float32) / 255
            x_test = f["x_test"].reshape(-1, 784).astype(np.float32) / 255
            return x_train, f["y_train"].astype(np.int32), x_test, f["y_test"].astype(np.int32)
    sizes = (640, 320) if args.short else (60000, 10000)
    (x_train, y_train), (x_test, y_test) = synthetic_mnist(*sizes, seed=args.seed)
    return x_train, y_train, x_test, y_test


def get_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x1 = keras.layers.Dense(64, activation="relu")(inputs)
    x2 = keras.layers.Dense(64, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    return keras.Model(inputs=inputs, outputs=outputs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.short:
        args.epochs = min(args.epochs, 2)
    strategy = ms.MultiWorkerMirroredStrategy()
    rank = strategy.extended.local_replica_ids[0]
    say = print if rank == 0 else (lambda *a, **k: None)
    global_batch = args.global_batch or args.batch_per_replica * strategy.num_replicas_in_sync

    x_train, y_train, x_test, y_test = load(args)
    # the original keeps 10,000 training rows for validation; a tenth here
    x_val, y_val = x_train[-len(x_train) // 10:], y_train[-len(x_train) // 10:]
    x_train, y_train = x_train[:-len(x_train) // 10], y_train[:-len(y_train) // 10]
    train_dataset = strategy.experimental_distribute_dataset(
        ms.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(1024, seed=args.seed).batch(global_batch))
    val_dataset = strategy.experimental_distribute_dataset(
        ms.data.Dataset.from_tensor_slices((x_val, y_val)).batch(global_batch))

    keras.utils.set_random_seed(args.seed)      # the same initial model on every rank
    model = get_model()
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x)
        per_example = loss_fn(y, y_pred)
        loss = ms.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        return loss, (y_pred, non_trainable_variables)

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable_variables, non_trainable_variables, optimizer_variables = state
        x, y = data
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y)
        grads = ms.nn.all_reduce_gradients(grads, strategy, "SUM")   # as TensorFlow's optimizer
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        correct = (y_pred.argmax(-1) == y).sum()
        return loss, correct, (trainable_variables, non_trainable_variables, optimizer_variables)

    @jax.jit
    def eval_step(state, data):
        trainable_variables, non_trainable_variables, _ = state
        x, y = data
        y_pred, _ = model.stateless_call(trainable_variables, non_trainable_variables, x)
        return (y_pred.argmax(-1) == y).sum()

    optimizer.build(model.trainable_variables)
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])

    def replica_train(data):
        nonlocal state
        loss, correct, state = train_step(state, data)
        return np.float32(loss), np.int64(correct), np.int64(len(data[1]))

    def replica_eval(data):
        return np.int64(eval_step(state, data)), np.int64(len(data[1]))

    step = 0
    for epoch in range(args.epochs):
        say(f"Start of epoch {epoch}")
        correct = rows = 0
        for data in train_dataset:
            loss, right, count = strategy.run(replica_train, args=(data,))
            loss = float(strategy.reduce("SUM", loss, axis=None))   # the global batch's mean
            correct += int(strategy.reduce("SUM", right, axis=None))
            rows += int(strategy.reduce("SUM", count, axis=None))
            if step % 10 == 0:
                say(f"Training loss (for 1 batch) at step {step}: {loss:.6f}")
                say(f"Seen so far: {(step + 1) * global_batch} samples")
            step += 1
        say(f"Training acc over epoch: {correct / rows:.4f}")
        right = count = 0
        for data in val_dataset:
            r, c = strategy.run(replica_eval, args=(data,))
            right += int(strategy.reduce("SUM", r, axis=None))
            count += int(strategy.reduce("SUM", c, axis=None))
        say(f"Validation acc: {right / count:.4f}")

    # as the original: write the final values back into the model's variables
    trainable_variables, non_trainable_variables, optimizer_variables = state
    for variable, value in zip(model.trainable_variables, trainable_variables):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable_variables):
        variable.assign(value)
    test_right = int(strategy.reduce("SUM", np.int64(
        (np.asarray(model.predict(x_test, verbose=0)).argmax(-1) == y_test).sum()), axis=None))
    say(f"Test acc (every rank on the whole test set): "
        f"{test_right / (len(y_test) * strategy.num_replicas_in_sync):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
