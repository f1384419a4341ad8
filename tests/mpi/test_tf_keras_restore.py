"""TensorFlow's Keras files restored at 1-3 ranks as TensorFlow restores them, by the object
graph's structure (tests/unit/test_tf_keras_structure.py has the single-process cases): every
rank ends with TensorFlow's own restored bytes, refusals are raised on every rank (none
left waiting in a collective), and values for layers built after the restore arrive on every
rank."""

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())


def tensorflows_bytes(variables, expected, world):
    """Each variable holds TensorFlow's restored bytes (integers in their own width), and
    every rank holds the same."""
    mine = []
    for variable, want in zip(variables, expected, strict=True):
        value = np.asarray(variable.value)
        stored = value.astype(want["dtype"]) if value.dtype.kind in "iu" else value
        assert list(stored.shape) == want["shape"], (variable.path, want["path"])
        assert stored.tobytes().hex() == want["hex"], (variable.path, want["path"])
        mine.append(stored.tobytes())
    everyone = world.comm.allgather(mine)
    assert all(other == mine for other in everyone)


@pytest.mark.mpi(min_size=1)
def test_a_shifted_model_gets_each_layers_own_values_on_every_rank(world):
    keras.backend.clear_session()
    keras.layers.Dense(7)                                      # names shifted by one layer
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ms.Checkpoint(model=model).restore(str(DATA / "keras_square/ckpt")).assert_consumed()
    tensorflows_bytes(model.weights, REPORT["keras_square/shifted"], world)


@pytest.mark.mpi(min_size=1)
def test_a_loss_scale_optimizer_under_a_model_given_as_root(world):
    want = REPORT["mixed_dense/adam_root"]
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                                  keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    status = ms.Checkpoint(model).restore(str(DATA / "mixed_dense/adam_root" / want["prefix"]))
    model.optimizer.build(model.trainable_variables)           # slots made after the restore
    status.assert_consumed()
    tensorflows_bytes(list(model.weights) + list(model.optimizer.variables), want["restored"],
                      world)


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.l1 = keras.layers.Dense(5)

    def call(self, x):
        return self.l1(x)


@pytest.mark.mpi(min_size=1)
def test_the_guides_net_built_after_the_restore_gets_its_values_on_every_rank(world):
    keras.backend.clear_session()
    net, opt = Net(), keras.optimizers.Adam(0.1)
    step = ms.Variable(1)
    status = ms.Checkpoint(step=step, optimizer=opt, net=net).restore(
        ms.train.latest_checkpoint(str(DATA / "guide")))
    net(np.ones((2, 4), np.float32))                      # this rank alone builds it
    opt.build(net.trainable_variables)
    assert int(step.numpy()) == REPORT["guide/restored"]["step"]
    tensorflows_bytes(net.weights + opt.variables, REPORT["guide/restored"]["restored"], world)
    assert status.unmatched_values == {"iterator/ITERATOR_STATE"}


@pytest.mark.mpi(min_size=1)
def test_a_saved_models_variables_are_refused_on_every_rank_and_restore_by_list(world):
    keras.backend.clear_session()
    layers = keras.layers
    model = keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(4, 3, activation="relu"),
                              layers.MaxPooling2D(2), layers.Conv2D(6, 3, activation="relu"),
                              layers.Flatten(), layers.Dropout(0.5),
                              layers.Dense(3, activation="softmax")])
    prefix = str(DATA / "export_cnn/variables/variables")
    with pytest.raises(ms.errors.InvalidArgumentError, match="variables of a SavedModel"):
        ms.Checkpoint(model=model).restore(prefix)
    ms.Checkpoint(variables=model.variables).restore(prefix).assert_existing_objects_matched()
    tensorflows_bytes(model.variables, REPORT["export_cnn"]["variables"]["restored"], world)


@pytest.mark.mpi(min_size=1)
def test_a_step_count_beyond_int32_is_refused_on_every_rank(world):
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    with pytest.raises(ms.errors.InvalidArgumentError, match="2147483653.*int32"):
        ms.Checkpoint(model=model, optimizer=optimizer).restore(str(DATA / "big_step/ckpt"))
    world.comm.Barrier()                                      # every rank got here
    assert int(optimizer.iterations.value) == 0
