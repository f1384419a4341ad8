"""TensorFlow's Keras files restored as TensorFlow restores them: by the object graph's
attribute structure, never by automatic layer names. Each expected value is what TensorFlow
2.21 itself put into a freshly built model when restoring the same files
(tests/data/make_tf_keras_fixtures.py); the model here is Keras 3 on JAX. Restores are
collective; one process is one rank here."""

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

import mpistrat as ms  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())


def assert_as_tensorflow_restored(variables, expected):
    """Each variable holds TensorFlow's restored bytes (an integer in its own width: Keras on
    JAX keeps int32 where TensorFlow holds int64)."""
    assert len(variables) == len(expected)
    for variable, want in zip(variables, expected):
        value = np.asarray(variable.value)
        assert list(value.shape) == want["shape"], (variable.path, want["path"])
        stored = value.astype(want["dtype"]) if value.dtype.kind in "iu" else value
        assert str(stored.dtype) == want["dtype"], (variable.path, want["path"])
        assert stored.tobytes().hex() == want["hex"], (variable.path, want["path"])


# -- 1. a SavedModel export ------------------------------------------------------------------
EXPORT = str(DATA / "export_cnn" / "variables" / "variables")


def _convnet():
    keras.backend.clear_session()
    layers = keras.layers
    return keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(4, 3, activation="relu"),
                             layers.MaxPooling2D(2), layers.Conv2D(6, 3, activation="relu"),
                             layers.Flatten(), layers.Dropout(0.5),
                             layers.Dense(3, activation="softmax")])


@pytest.mark.parametrize("given", ["model=model", "model as root"])
def test_a_saved_model_export_into_the_model_is_refused_naming_the_way(given):
    """Before, the restore matched the Dropout's seed state by name and nothing else, and the
    convnet predicted with its initial weights (off by up to 1.16). TensorFlow restores
    nothing here; we say so and how to restore it, before anything is assigned."""
    assert REPORT["export_cnn"]["model"]["changed"] == []        # TensorFlow: nothing
    model = _convnet()
    before = [np.asarray(v.value).copy() for v in model.variables]
    checkpoint = ms.Checkpoint(model=model) if given == "model=model" else ms.Checkpoint(model)
    with pytest.raises(ms.errors.InvalidArgumentError,
                       match=r"variables of a SavedModel .*\(7 in 'variables'\).*"
                             r"ms\.Checkpoint\(variables=model\.variables\)"):
        checkpoint.restore(EXPORT)
    assert all(np.array_equal(np.asarray(v.value), b) for v, b in zip(model.variables, before))


def test_a_saved_model_export_restores_in_the_models_variable_order_as_tensorflow():
    model = _convnet()
    status = ms.Checkpoint(variables=model.variables).restore(EXPORT)
    status.assert_existing_objects_matched()
    assert_as_tensorflow_restored(model.variables, REPORT["export_cnn"]["variables"]["restored"])
    # (trainable_variables/N are the same objects as variables/N; _all_variables/N are
    # TensorFlow's copies, in an order of a set: left over, as in TensorFlow)
    assert {p.split("/")[0] for p in status.unmatched_values} == {"_all_variables"}


# -- 2. mixed_float16 models fit by TensorFlow, in two layouts ---------------------------------
def _mixed_dense(optimizer):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                                  keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd"
                      else keras.optimizers.Adam(0.01), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


@pytest.mark.parametrize("name", ["adam_root", "sgd_kw"])
def test_every_loss_scale_optimizer_slot_restores_as_tensorflow_restores_it(name):
    """tf.train.Checkpoint(model) with Adam, and (model=, optimizer=) with SGD and momentum,
    restored into a model whose automatic names shifted (sequential_1, adam_1: another model
    built first), the optimizer built after the restore: every weight, the loss scale and its
    counters, and every slot of the inner optimizer, bit for bit."""
    want = REPORT[f"mixed_dense/{name}"]
    keras.backend.clear_session()
    _mixed_dense(name[:4].rstrip("_"))                              # names shifted by one model
    model = _mixed_dense(name[:4].rstrip("_"))
    assert type(model.optimizer).__name__ == want["optimizer"] == "LossScaleOptimizer"
    checkpoint = ms.Checkpoint(model) if name.endswith("root") else \
        ms.Checkpoint(model=model, optimizer=model.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        status = checkpoint.restore(str(DATA / "mixed_dense" / name / want["prefix"]))
        model.optimizer.build(model.trainable_variables)             # the slots appear now
    status.assert_consumed()
    assert_as_tensorflow_restored(list(model.weights) + list(model.optimizer.variables),
                                  want["restored"])


def test_an_optimizer_built_by_fit_after_the_restore_continues_from_the_restored_state():
    want = REPORT["mixed_dense/sgd_kw"]
    keras.backend.clear_session()
    model = _mixed_dense("sgd")
    ms.Checkpoint(model=model, optimizer=model.optimizer).restore(
        str(DATA / "mixed_dense/sgd_kw" / want["prefix"])).expect_partial()
    model.fit(np.ones((4, 4), np.float32), np.ones((4, 2), np.float32), batch_size=4,
              epochs=1, verbose=0)                                  # builds, then one step
    inner = [e for e in want["restored"] if e["path"] == "sgd_1/iteration"][0]
    steps = int(np.frombuffer(bytes.fromhex(inner["hex"]), np.int64)[0])
    assert steps == 4 and int(model.optimizer.inner_optimizer.iterations.value) == steps + 1


# -- 3. TensorFlow's "Training checkpoints" guide ------------------------------------------------
class Net(keras.Model):
    """The guide's network, tf.keras replaced by keras."""

    def __init__(self):
        super().__init__()
        self.l1 = keras.layers.Dense(5)

    def call(self, x):
        return self.l1(x)


def test_the_guides_checkpoint_restores_its_net_and_optimizer_and_names_the_iterator():
    """Before, the Net (built at its first call, after the restore) kept its initial kernel
    and zero bias: the values waited for names Keras on JAX does not give (net/dense/kernel
    here, net/kernel in TensorFlow's file), and Keras dropped what was assigned while it
    built the layer inside a symbolic call. The iterator's state is a TensorFlow variant:
    left over, by name."""
    keras.backend.clear_session()
    want = REPORT["guide/restored"]
    inputs = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    net, opt = Net(), keras.optimizers.Adam(0.1)
    iterator = iter(ms.data.Dataset.from_tensor_slices(
        {"x": inputs, "y": inputs[:, :1] * 3}).repeat(10).batch(2))
    ckpt = ms.Checkpoint(step=ms.Variable(1), optimizer=opt, net=net, iterator=iterator)
    manager = ms.CheckpointManager(ckpt, str(DATA / "guide"), max_to_keep=3)
    status = ckpt.restore(manager.latest_checkpoint)
    net(inputs[:2])                                       # built after the restore
    opt.build(net.trainable_variables)
    assert int(ckpt.step.numpy()) == want["step"] == 5
    assert_as_tensorflow_restored(net.weights + opt.variables, want["restored"])
    status.assert_existing_objects_matched()
    assert status.unmatched_values == {"iterator/ITERATOR_STATE"}
    with pytest.raises(AssertionError, match="iterator/ITERATOR_STATE"):
        status.assert_consumed()
    status.expect_partial()


@pytest.mark.parametrize("model", ["Sequential", "Net"])
def test_a_model_first_built_by_fit_trains_from_the_restored_values(model):
    """Keras on JAX builds a model without an Input inside fit's symbolic run, where it drops
    whatever is assigned: before, such a model trained from its initial weights, silently.
    The restored values become the variables' initial values there (a rate of 0 keeps them)."""
    keras.backend.clear_session()
    if model == "Sequential":
        net = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(3)])
        source, want, width = "keras_square/ckpt", REPORT["keras_square/shifted"], 3
        checkpoint = ms.Checkpoint(model=net)
    else:
        net = Net()
        source, want, width = "guide/ckpt-4", REPORT["guide/restored"]["restored"][:2], 4
        checkpoint = ms.Checkpoint(net=net)
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    status = checkpoint.restore(str(DATA / source)).expect_partial()
    net.fit(np.ones((4, width), np.float32), np.ones((4, 3 if width == 3 else 5), np.float32),
            epochs=1, verbose=0)
    assert_as_tensorflow_restored(net.weights, want)
    assert not {p for p in status.unmatched_values if "/l1/" in p or "_operations" in p}


def test_our_own_checkpoint_of_a_subclassed_model_restores_into_one_built_later(tmp_path):
    """The same for our format: values for a layer built inside its caller's symbolic run."""
    keras.backend.clear_session()
    saved = Net()
    saved(np.ones((2, 4), np.float32))
    path = ms.Checkpoint(net=saved).save(str(tmp_path / "ckpt"))
    fresh = Net()
    ms.Checkpoint(net=fresh).restore(path)
    fresh(np.ones((2, 4), np.float32))                 # built at its first call
    for ours, theirs in zip(fresh.weights, saved.weights, strict=True):
        assert np.asarray(ours.value).tobytes() == np.asarray(theirs.value).tobytes()


# -- 4. automatic names shifted -------------------------------------------------------------------
def test_shifted_automatic_names_restore_each_layer_its_own_values_without_a_warning():
    """Before, a model built after one more Dense (dense_1, dense_2 here; dense, dense_1 in the
    file) gave its first layer the file's second layer, with only a warning. TensorFlow binds
    by structure (model/_functional/_operations/N): so do we."""
    keras.backend.clear_session()
    keras.layers.Dense(7)                                      # one more layer, made first
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(3)])
    assert [v.path for v in model.weights][0] == "sequential/dense_1/kernel"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ms.Checkpoint(model=model).restore(str(DATA / "keras_square/ckpt")).assert_consumed()
    assert_as_tensorflow_restored(model.weights, REPORT["keras_square/shifted"])


@pytest.mark.parametrize("name", ["keras_square/ckpt", "mixed_dense/sgd_kw/ckpt-1"])
def test_a_converted_file_restores_a_shifted_model_as_tensorflow_restores_it(name, tmp_path):
    """A file converted to ours keeps TensorFlow's paths: matched by the same structure
    (before, by automatic names: the shifted model's first layer took the second's)."""
    from mpistrat.convert import convert
    convert(str(DATA / name), str(tmp_path / "ours"))
    keras.backend.clear_session()
    if name.startswith("keras_square"):
        keras.layers.Dense(7)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(3)])
        variables, want = (lambda: model.weights), REPORT["keras_square/shifted"]
        checkpoint = ms.Checkpoint(model=model)
    else:   # (built first: our walk numbers an unbuilt LossScaleOptimizer's variables apart)
        _mixed_dense("sgd")
        model = _mixed_dense("sgd")
        model.optimizer.build(model.trainable_variables)
        variables = lambda: list(model.weights) + list(model.optimizer.variables)  # noqa: E731
        want = REPORT["mixed_dense/sgd_kw"]["restored"]
        checkpoint = ms.Checkpoint(model=model, optimizer=model.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        status = checkpoint.restore(str(tmp_path / "ours"))
    assert status.missing_objects <= {"save_counter"}      # (keras_square was written, not saved)
    assert_as_tensorflow_restored(variables(), want)


def test_two_objects_contending_for_one_value_are_warned_and_the_first_takes_it():
    """The file's kernels are shared by model and optimizer; here the optimizer was built on
    another model's variables, so TensorFlow's graph reaches two objects of ours for each:
    the first path in TensorFlow's order (optimizer/_trainable_variables/N) takes the value,
    as in TensorFlow, and the ambiguity is warned."""
    keras.backend.clear_session()

    def dense():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                                 keras.layers.Dense(2)])
    model, other = dense(), dense()
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(other.trainable_variables)
    with pytest.warns(RuntimeWarning, match=r"structure is ambiguous: the checkpoint's "
                                            r"'optimizer/_trainable_variables/0' is reached at "
                                            r"two different objects of ours"):
        status = ms.Checkpoint(model=model, optimizer=optimizer).restore(
            str(DATA / "keras/ckpt-1"))
    kernel = REPORT["keras/ckpt-1"]["optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"]
    assert np.asarray(other.weights[0].value).tobytes().hex() == kernel["hex"]
    assert "model/layer-0/kernel" in status.missing_objects


# -- 5. an iterations count beyond int32 -----------------------------------------------
def test_a_step_count_beyond_int32_is_refused_by_name_not_wrapped():
    assert REPORT["big_step"] == {"iterations": 2 ** 31 + 5, "dtype": "int64"}
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    assert optimizer.iterations.dtype == "int32"               # Keras 3 on JAX
    with pytest.raises(ms.errors.InvalidArgumentError,
                       match=r"'optimizer/iterations'.*int64 values from 2147483653 to "
                             r"2147483653, which do not fit the object's int32"):
        ms.Checkpoint(model=model, optimizer=optimizer).restore(str(DATA / "big_step/ckpt"))
    assert int(optimizer.iterations.value) == 0
