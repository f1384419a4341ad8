"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", ported to mpistrat + JAX.

    scripts/mpirun -n 2 .venv/bin/python jobs/examples/custom_training.py --short

A small CNN learns Fashion-MNIST-like images; each replica computes the loss of its share of
the global batch, scaled as TensorFlow scales it, and the gradients are summed over replicas.

Changes from the original (https://www.tensorflow.org/tutorials/distribute/custom_training):

* ``import mpistrat as ms`` for ``tf.distribute``/``tf.train``/``tf.nn``; launch with
  ``mpirun -n N`` (one replica per rank) instead of one process driving several GPUs.
  ``MirroredStrategy`` is kept: it spans the ranks of one node.
* The model is JAX functions (``jax.lax.conv``) instead of ``tf.keras.Sequential``: the same
  layers (conv 32, max-pool, conv 64, max-pool, dense 64 with L2 1e-4, dense 10 with L2 1e-4);
  ``tf.GradientTape`` becomes ``jax.value_and_grad``; ``tf.function`` becomes ``jax.jit``.
* The optimizer is optax's Adam. TensorFlow's optimizer sums the replicas' gradients inside
  ``apply_gradients``; optax does not, so ``ms.nn.aggregate_gradients(strategy, "SUM")`` comes
  first in its chain (the sum, because ``compute_average_loss`` already divided by the
  global batch). Without it the replicas would drift apart.
* The data: ``keras.datasets.fashion_mnist`` is downloaded by the original. Here, without
  network access, a synthetic stand-in of the same shapes is made from a seed (ten class
  templates plus noise); ``--data FILE.npz`` (arrays ``x_train, y_train, x_test, y_test``)
  uses the real one. ``tf.data`` becomes ``ms.data`` with the same calls; the shuffle is
  given a seed, so every rank agrees on the order.
* ``--global-batch`` fixes the global batch (the original always uses 64 per replica), so runs
  at different widths see the same batches and give the same losses (the launcher test
  compares 1 and 2 ranks).
* Metrics are sums reduced with ``strategy.reduce`` instead of ``tf.keras.metrics`` objects.
* The checkpoint holds the parameters and Adam's state as ``ms.Variable`` objects (leaf by
  leaf) and the epoch; it is saved every 2 epochs by a ``CheckpointManager`` and the last one
  is restored to evaluate, as the original restores into a new model.
* ``--short``: a few hundred rows and 2 epochs, for tests.
"""

import argparse
import os
import sys
import tempfile

import numpy as np

import jax
import jax.numpy as jnp
import optax

import mpistrat as ms


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="rows per step over all replicas (default: 64 x replicas)")
    parser.add_argument("--data", default=None, help="an .npz with the real Fashion-MNIST")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--short", action="store_true", help="a short run (tests)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# -- data -------------------------------------------------------------------------------------
def synthetic_fashion_mnist(train: int, test: int, seed: int):
    """Ten 28x28 class templates plus noise, labels 0-9: the shapes and dtypes of the real set."""
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0, 255, size=(10, 28, 28))

    def make(count):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        noise = rng.normal(0, 40, size=(count, 28, 28))
        images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
        return images, labels

    return make(train), make(test)


def load(args):
    if args.data:
        with np.load(args.data) as f:
            (x_train, y_train), (x_test, y_test) = (f["x_train"], f["y_train"]), \
                (f["x_test"], f["y_test"])
    else:
        sizes = (512, 256) if args.short else (60000, 10000)
        (x_train, y_train), (x_test, y_test) = synthetic_fashion_mnist(*sizes, seed=args.seed)
    # a channel axis, and pixels in [0, 1], as the original does
    x_train = x_train[..., None] / np.float32(255)
    x_test = x_test[..., None] / np.float32(255)
    return (x_train.astype(np.float32), y_train.astype(np.int32),
            x_test.astype(np.float32), y_test.astype(np.int32))


# -- model ------------------------------------------------------------------------------------
def init_params(seed: int):
    """Glorot-uniform kernels and zero biases, as Keras initialises them."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)

    def glorot(key, shape, fan_in, fan_out):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return jax.random.uniform(key, shape, jnp.float32, -limit, limit)

    return {
        "conv1": {"kernel": glorot(keys[0], (3, 3, 1, 32), 9, 9 * 32), "bias": jnp.zeros(32)},
        "conv2": {"kernel": glorot(keys[1], (3, 3, 32, 64), 9 * 32, 9 * 64),
                  "bias": jnp.zeros(64)},
        "dense1": {"kernel": glorot(keys[2], (1600, 64), 1600, 64), "bias": jnp.zeros(64)},
        "dense2": {"kernel": glorot(keys[3], (64, 10), 64, 10), "bias": jnp.zeros(10)},
    }


def _conv(x, layer):
    y = jax.lax.conv_general_dilated(x, layer["kernel"], (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + layer["bias"])


def _pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def logits(params, images):
    x = _pool(_conv(images, params["conv1"]))         # 26x26x32 -> 13x13x32
    x = _pool(_conv(x, params["conv2"]))              # 11x11x64 -> 5x5x64
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return x @ params["dense2"]["kernel"] + params["dense2"]["bias"]


def regularization_losses(params):
    """The two dense layers' L2(1e-4) penalties (Keras's ``model.losses``)."""
    return jnp.stack([1e-4 * jnp.sum(params[name]["kernel"] ** 2)
                      for name in ("dense1", "dense2")])


# -- training ---------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.short:
        args.epochs = min(args.epochs, 2)
    strategy = ms.MirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    rank = strategy.extended.local_replica_ids[0]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"Number of devices: {replicas}")

    x_train, y_train, x_test, y_test = load(args)
    global_batch = args.global_batch or args.batch_per_replica * replicas
    train_dataset = ms.data.Dataset.from_tensor_slices((x_train, y_train)) \
        .shuffle(len(x_train), seed=args.seed).batch(global_batch)
    test_dataset = ms.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    train_dist = strategy.experimental_distribute_dataset(train_dataset)
    test_dist = strategy.experimental_distribute_dataset(test_dataset)

    with strategy.scope():
        params = init_params(args.seed)   # the same seed on every rank: the same model
        optimizer = optax.chain(ms.nn.aggregate_gradients(strategy, "SUM"), optax.adam(1e-3))
        opt_state = optimizer.init(params)

    def compute_loss(params, images, labels):
        per_example = optax.softmax_cross_entropy_with_integer_labels(
            logits(params, images), labels)
        loss = ms.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        return loss + ms.nn.scale_regularization_loss(regularization_losses(params))

    @jax.jit
    def update(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(compute_loss)(params, images, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)  # summed over replicas
        out = logits(params, images)
        correct = jnp.sum(jnp.argmax(out, -1) == labels)
        return optax.apply_updates(params, updates), opt_state, loss, correct

    def train_step(inputs):
        nonlocal params, opt_state
        images, labels = inputs
        params, opt_state, loss, correct = update(params, opt_state, images, labels)
        return np.float32(loss), np.int64(correct), np.int64(len(labels))

    @jax.jit
    def evaluate(params, images, labels):
        out = logits(params, images)
        per_example = optax.softmax_cross_entropy_with_integer_labels(out, labels)
        return jnp.sum(per_example), jnp.sum(jnp.argmax(out, -1) == labels)

    def test_step(inputs):
        images, labels = inputs
        loss_sum, correct = evaluate(params, images, labels)
        return np.float64(loss_sum), np.int64(correct), np.int64(len(labels))

    # the checkpoint: parameters and Adam's state leaf by leaf, and the epoch
    directory = args.checkpoint_dir or strategy.extended.engine.broadcast_object(
        tempfile.mkdtemp(prefix="custom_training-") if rank == 0 else None)
    with strategy.scope():
        state_vars = {str(i): ms.Variable(np.asarray(leaf))
                      for i, leaf in enumerate(jax.tree.leaves((params, opt_state)))}
        epoch_var = ms.Variable(np.int64(0))
    checkpoint = ms.Checkpoint(state=state_vars, epoch=epoch_var)
    manager = ms.CheckpointManager(checkpoint, directory, max_to_keep=2)

    for epoch in range(args.epochs):
        total_loss, correct, batches, rows = 0.0, 0, 0, 0
        for inputs in train_dist:
            loss, right, count = strategy.run(train_step, args=(inputs,))
            total_loss += float(strategy.reduce("SUM", loss, axis=None))  # the global mean
            correct += int(strategy.reduce("SUM", right, axis=None))
            rows += int(strategy.reduce("SUM", count, axis=None))
            batches += 1
        train_loss = total_loss / batches
        test_loss, test_correct, test_rows = 0.0, 0, 0
        for inputs in test_dist:
            loss_sum, right, count = strategy.run(test_step, args=(inputs,))
            test_loss += float(strategy.reduce("SUM", loss_sum, axis=None))
            test_correct += int(strategy.reduce("SUM", right, axis=None))
            test_rows += int(strategy.reduce("SUM", count, axis=None))
        if epoch % 2 == 0 or epoch == args.epochs - 1:
            for var, leaf in zip(state_vars.values(), jax.tree.leaves((params, opt_state))):
                var.assign(np.asarray(leaf))
            epoch_var.assign(epoch + 1)
            manager.save()
        say(f"Epoch {epoch + 1}, Loss: {train_loss:.6f}, Accuracy: {100 * correct / rows:.2f}, "
            f"Test Loss: {test_loss / test_rows:.6f}, "
            f"Test Accuracy: {100 * test_correct / test_rows:.2f}")

    # restore the latest checkpoint into fresh parameters and evaluate, as the original does
    fresh = jax.tree.structure((params, opt_state))
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    params, opt_state = jax.tree.unflatten(
        fresh, [jnp.asarray(v.numpy()) for v in state_vars.values()])
    loss_sum, right, count = 0.0, 0, 0
    for inputs in test_dist:
        a, b, c = strategy.run(test_step, args=(inputs,))
        loss_sum += float(strategy.reduce("SUM", a, axis=None))
        right += int(strategy.reduce("SUM", b, axis=None))
        count += int(strategy.reduce("SUM", c, axis=None))
    say(f"Accuracy after restoring the saved model without strategy: {100 * right / count:.2f} "
        f"(epoch {int(epoch_var.numpy())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
