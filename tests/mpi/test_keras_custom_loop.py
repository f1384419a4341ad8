"""TensorFlow's multi-worker custom-loop tutorial, as a Keras 3 (JAX) user writes it under
mpistrat (issue 44): model, optimizer and metrics made in ``strategy.scope()``, a distributed
dataset, ``strategy.run(train_step)`` whose step computes the loss scaled by the global batch
and calls ``optimizer.apply_gradients``, then ``strategy.reduce`` of the losses and
``metric.result()``. As TensorFlow's optimizers do in a replica context, the gradients are
summed over the replicas before they are applied: every rank ends with the weights of one
process training on the global batches (before, each replica applied its own and they
drifted apart, silently). A metric made in the scope reads as TensorFlow's SyncOnRead metric:
``result()`` is the global value, not this rank's."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")
jax = pytest.importorskip("jax")

import mpistrat as ms  # noqa: E402

pytestmark = [pytest.mark.numpy_only("Keras values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "Keras custom loops run at 1-3 ranks (widths 1, 2 and an odd one)"))]

ROWS, BATCH = 20, 8      # at 3 ranks: 3/3/2 rows, then 2/2/0 in the short last batch


def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2)) + 0.3).astype(np.float32)
    return x, y


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(2)])
    return model, keras.optimizers.SGD(0.2)


def per_example_loss(model, trainable, x, y):
    non_trainable = [v.value for v in model.non_trainable_variables]
    prediction, _ = model.stateless_call(trainable, non_trainable, x)
    return jax.numpy.mean((prediction - y) ** 2, axis=1)


def step(model, optimizer, x, y, global_batch, **apply_kwargs):
    """The tutorial's train_step: the loss summed over this replica's rows / global batch."""
    def loss_fn(trainable):
        return jax.numpy.sum(per_example_loss(model, trainable, x, y)) / global_batch
    loss, grads = jax.value_and_grad(loss_fn)([v.value for v in model.trainable_variables])
    optimizer.apply_gradients(zip(grads, model.trainable_variables), **apply_kwargs)
    return loss


def reference_weights(epochs):
    """One process, no strategy, on the same global batches."""
    x, y = data()
    model, optimizer = build()
    for _ in range(epochs):
        for start in range(0, ROWS, BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            step(model, optimizer, xb, yb, len(xb))
    return [np.asarray(v.value) for v in model.weights]


def in_the_scope():
    """The tutorial's set-up: model, optimizer and a metric made in the scope, and the
    distributed dataset of the global batches."""
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, optimizer = build()
        metric = keras.metrics.Mean()
    x, y = data()
    dataset = strategy.experimental_distribute_dataset(
        ms.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    return strategy, model, optimizer, metric, dataset


@pytest.mark.mpi(min_size=1)
def test_the_custom_loop_tutorial_trains_one_model_on_the_global_batch(world):
    strategy, model, optimizer, seen, dataset = in_the_scope()

    rows = []

    def train_step(inputs, global_batch):
        xb, yb = inputs
        loss = step(model, optimizer, xb, yb, global_batch)
        seen.update_state(np.ones(len(xb), np.float32) * (world.rank + 1))
        rows.append(len(xb))
        return loss

    epochs, totals = 2, []
    for _ in range(epochs):
        for start, batch in zip(range(0, ROWS, BATCH), dataset):
            global_batch = min(BATCH, ROWS - start)
            losses = strategy.run(train_step, args=(batch, global_batch))
            totals.append(float(strategy.reduce("SUM", losses, axis=None)))
    mine = [np.asarray(v.value) for v in model.weights]
    everyone = world.comm.allgather(mine)
    for other in everyone[1:]:                      # the replicas never drift apart ...
        for a, b in zip(everyone[0], other):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(mine, reference_weights(epochs)):   # ... and train one model
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    # the metric made in the scope reads globally: the mean of rank+1 over every row seen
    counts = world.comm.allgather(sum(rows))
    expected = sum((r + 1) * c for r, c in enumerate(counts)) / sum(counts)
    assert float(seen.result()) == pytest.approx(expected, rel=1e-6), (counts, expected)
    assert sum(counts) == ROWS * epochs


@pytest.mark.mpi(min_size=2)
def test_skip_gradients_aggregation_applies_this_replicas_own(world):
    strategy, model, optimizer, alone, dataset = in_the_scope()
    batch = next(iter(dataset))

    def train_step(inputs):
        step(model, optimizer, *inputs, BATCH, skip_gradients_aggregation=True)
        alone.update_state(float(world.rank == 0))
        return alone.result()                       # inside run: this replica's own value

    inside = strategy.run(train_step, args=(batch,))
    assert float(inside) == float(world.rank == 0)
    kernels = world.comm.allgather(np.asarray(model.weights[0].value))
    assert not np.array_equal(kernels[0], kernels[1])   # each its own, as asked
    assert float(alone.result()) == pytest.approx(1.0 / world.size)   # global when read


@pytest.mark.mpi(min_size=1)
def test_a_metric_made_outside_the_scope_stays_this_ranks_own(world):
    ms.MultiWorkerMirroredStrategy()
    outside = keras.metrics.Mean()
    outside.update_state(float(world.rank))
    assert float(outside.result()) == float(world.rank)
