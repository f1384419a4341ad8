"""SyncBatchNormalization wherever a job of several ranks trains it (issue 44): a model built
before the strategy's scope and compiled inside it (or compiled with hvd.DistributedOptimizer,
which has no scope) synchronises as one built in the scope does; one that trains with no
distributed model at all in a job of several ranks is refused by name, where it normalised
with its own replica's rows without a word."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

import mpistrat as ms  # noqa: E402

pytestmark = [pytest.mark.numpy_only("Keras values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "Keras fit runs at 1-3 ranks (widths 1, 2 and an odd one)"))]

ROWS, BATCH = 20, 8


def data():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((ROWS, 4)) * 3 + 1).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2))).astype(np.float32)
    return x, y


def layers(norm):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, use_bias=False),
                             norm(momentum=0.5), keras.layers.Activation("tanh"),
                             keras.layers.Dense(2)])


def weights(model):
    return [np.asarray(v.value) for v in model.weights]


@pytest.mark.mpi(min_size=1)
def test_a_model_built_before_the_scope_synchronises_once_compiled_in_it(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    model = layers(ms.keras.SyncBatchNormalization)       # outside the scope
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    single = ms.keras.train_alone(layers(keras.layers.BatchNormalization))
    single.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(weights(model), weights(single)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.mpi(min_size=2)
def test_training_it_with_nothing_distributed_in_a_job_of_several_ranks_is_refused(world):
    x, _ = data()
    model = layers(ms.keras.SyncBatchNormalization)
    with pytest.raises(ValueError, match=r"made outside strategy.scope\(\).*this replica's "
                                         r"rows only"):
        model(x, training=True)
    per_replica = layers(lambda **kw: ms.keras.SyncBatchNormalization(
        synchronized=False, **kw))                                 # asked for: no refusal
    assert per_replica(x, training=True).shape == (ROWS, 2)
    assert per_replica.layers[1].get_config()["synchronized"] is False
