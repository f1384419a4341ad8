"""Non-trainable Keras state after ``fit`` under a strategy (issue 44): what the step writes is
the same on every rank, bitwise, so callbacks, evaluation and checkpoints see one value.

19 rows in batches of 6 end with a batch of 1 row: at 2 and 3 ranks the later replicas get
none in that step."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

import mpistrat as ms  # noqa: E402

pytestmark = [pytest.mark.numpy_only("Keras values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "Keras fit runs at 1-3 ranks (as test_keras_fit.py)"))]

ROWS, BATCH = 19, 6


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kerasstate")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def data():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((ROWS, 4)) * 2 + 3).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2))).astype(np.float32)
    return x, y


def state(model):
    """``{name within the model: value}`` of its non-trainable variables."""
    return {f"{i}:{v.name}": np.asarray(v.value)
            for i, v in enumerate(model.non_trainable_variables)}


def same_on_every_rank(world, values):
    views = world.comm.allgather({k: v.tobytes() for k, v in values.items()})
    assert all(view == views[0] for view in views), \
        [k for k in views[0] if any(view[k] != views[0][k] for view in views)]


def fit_and_restore(world, strategy, build, shared_dir, name):
    x, y = data()
    with strategy.scope():
        model = build()
    before = state(model)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    after = state(model)
    same_on_every_rank(world, after)
    path = ms.Checkpoint(model=model).save(os.path.join(shared_dir, name))
    with strategy.scope():
        fresh = build()
    ms.Checkpoint(model=fresh).restore(path).assert_consumed()
    for key, value in state(fresh).items():
        assert value.tobytes() == after[key].tobytes(), key
    return before, after


@pytest.mark.mpi(min_size=1)
def test_renorm_statistics_agree_and_are_saved(world, shared_dir):
    """Before, only moving_mean and moving_variance were averaged: renorm's moving_stddev,
    renorm_mean and renorm_stddev drifted apart and a checkpoint refused them."""
    strategy = ms.MultiWorkerMirroredStrategy()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                                  keras.layers.BatchNormalization(renorm=True),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        return model

    before, after = fit_and_restore(world, strategy, build, shared_dir, "renorm")
    moved = [k for k in after if not np.array_equal(before[k], after[k])]
    assert len(moved) == 5, moved   # all five statistics trained


@pytest.mark.mpi(min_size=1)
def test_dropout_seeds_advance_alike_with_an_empty_replica(world, shared_dir):
    """Before, a replica without rows skipped the step, its seed generator fell one step
    behind the others' and a checkpoint refused it ('values differ between ranks'). Every
    replica now steps it, as one process does once per batch."""
    strategy = ms.MultiWorkerMirroredStrategy()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                                  keras.layers.Dropout(0.3), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        return model

    _, after = fit_and_restore(world, strategy, build, shared_dir, "dropout")
    alone = ms.keras.train_alone(build())
    alone.fit(*data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for key, value in state(alone).items():   # (the seed generator: one step per batch)
        assert value.tobytes() == after[key].tobytes(), key


@pytest.mark.mpi(min_size=1)
def test_frozen_layers_stay_bitwise_as_they_were(world, shared_dir):
    """State the step never writes (a frozen layer's kernel) is not averaged: (x+x+x)/3 need
    not be x in float32."""
    strategy = ms.MultiWorkerMirroredStrategy()

    def build():
        keras.utils.set_random_seed(0)
        frozen = keras.layers.Dense(6)   # (seeded glorot values: some x with (3x)/3 != x)
        model = keras.Sequential([keras.Input((4,)), frozen, keras.layers.BatchNormalization(),
                                  keras.layers.Dense(2)])
        frozen.trainable = False
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        return model

    before, after = fit_and_restore(world, strategy, build, shared_dir, "frozen")
    for key in before:
        if "moving" not in key:
            assert before[key].tobytes() == after[key].tobytes(), key
        else:
            assert not np.array_equal(before[key], after[key]), key


@pytest.mark.mpi(min_size=1)
def test_bfloat16_statistics_are_averaged_and_agree(world, shared_dir):
    """Before, only dtypes NumPy calls floating were averaged: under the "bfloat16" policy
    (ml_dtypes' bfloat16, kind 'V') BatchNormalization's moving statistics drifted apart per
    rank. They are averaged in float32 and cast back, the same bits on every rank."""
    strategy = ms.MultiWorkerMirroredStrategy()
    policy = keras.config.dtype_policy()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        return model

    keras.config.set_dtype_policy("bfloat16")
    try:
        before, after = fit_and_restore(world, strategy, build, shared_dir, "bfloat16")
        with strategy.scope():
            dtypes = {str(v.dtype) for v in build().non_trainable_variables}
    finally:
        keras.config.set_dtype_policy(policy)
    assert dtypes == {"bfloat16"}, dtypes
    moved = [k for k in after if "moving" in k and not np.array_equal(before[k], after[k])]
    assert len(moved) == 2, moved
