"""TensorFlow's own restores of Keras files, for tests/data/tf/ (``make_tf_fixtures.py`` runs
these with the others; TensorFlow 2.21 in a separate environment, never a dependency).

Each fixture saves with TensorFlow as a user does, then restores the files with TensorFlow
into a freshly built model, and records what TensorFlow put into every variable (in the order
of ``model.weights`` then ``optimizer.variables``, the same on every Keras backend), so the
tests compare mpistrat's restore with TensorFlow's bit for bit:

* ``export_cnn/``: the variables of ``model.export(path)`` (a SavedModel) of a small Keras
  convnet trained one step; ``saved_model.pb`` is left out (only its ``variables/`` is read).
  TensorFlow restores it through ``tf.train.Checkpoint(variables=model.variables)`` and
  restores nothing through ``tf.train.Checkpoint(model=model)``.
* ``mixed_dense/``: Dense-only ``mixed_float16`` models fit by TensorFlow (a
  LossScaleOptimizer), saved as ``tf.train.Checkpoint(model)`` with Adam (``adam_root``)
  and as ``tf.train.Checkpoint(model=..., optimizer=...)`` with SGD and momentum
  (``sgd_kw``), restored by TensorFlow into a model whose automatic names shifted (another
  model built first), its optimizer built after the restore.
* ``keras_square/shifted``: ``keras_square/ckpt`` restored into a model built after one more
  Dense layer (automatic names shifted by one).
* ``guide/restored``: ``guide/ckpt-4`` restored into the guide's fresh ``Net`` and Adam.
  TensorFlow's answer is its restore into a built ``Net`` and optimizer: restoring into a
  ``Net`` not built yet, TensorFlow 2.21 with Keras 3 leaves the layer with two kernels
  (the one its deferred restore made, and an unrestored one the layer uses) and the
  optimizer with slots for both, a defect of theirs; mpistrat gives the lazily built
  ``Net`` the values TensorFlow gives the built one.
* ``big_step/``: a Keras model whose Adam has run 2**31 + 5 steps (an ``iterations``
  beyond int32).
"""

import os
import shutil

import numpy as np
import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf")


def _variables_json(variables) -> list:
    """Each variable as TensorFlow holds it: its Keras path, dtype, shape and bytes (hex)."""
    out = []
    for variable in variables:
        value = np.array(variable.numpy())            # (0-d stays 0-d, C order)
        out.append({"path": variable.path, "dtype": value.dtype.name, "shape": list(value.shape),
                    "hex": value.tobytes().hex()})
    return out


def _convnet(keras):
    layers = keras.layers
    return keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(4, 3, activation="relu"),
                             layers.MaxPooling2D(2), layers.Conv2D(6, 3, activation="relu"),
                             layers.Flatten(), layers.Dropout(0.5),
                             layers.Dense(3, activation="softmax")])


def export_cnn(report: dict) -> None:
    import keras
    keras.backend.clear_session()
    keras.utils.set_random_seed(3)
    model = _convnet(keras)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    x = np.random.default_rng(0).random((4, 8, 8, 1)).astype(np.float32)
    model.fit(x, np.eye(3, dtype=np.float32)[[0, 1, 2, 0]], epochs=1, verbose=0)
    directory = os.path.join(OUT, "export_cnn")
    model.export(directory)
    for name in os.listdir(directory):      # the variables bundle is what a restore reads
        if name != "variables":
            path = os.path.join(directory, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    prefix = os.path.join(directory, "variables", "variables")
    answers = {}
    for how in ("variables", "model"):
        keras.backend.clear_session()
        keras.utils.set_random_seed(99)
        fresh = _convnet(keras)
        before = [v.numpy().copy() for v in fresh.variables]
        ckpt = tf.train.Checkpoint(variables=fresh.variables) if how == "variables" \
            else tf.train.Checkpoint(model=fresh)
        ckpt.restore(prefix).expect_partial()
        answers[how] = {"restored": _variables_json(fresh.variables),
                        "changed": [v.path for v, b in zip(fresh.variables, before)
                                    if not np.array_equal(v.numpy(), b)]}
    report["export_cnn"] = answers


def _mixed_dense(keras, optimizer: str, seed: int):
    keras.utils.set_random_seed(seed)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                                  keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd"
                      else keras.optimizers.Adam(0.01), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def mixed_dense(report: dict) -> None:
    import keras
    x = np.random.default_rng(1).random((8, 4)).astype(np.float32)
    for optimizer, layout in (("adam", "root"), ("sgd", "kw")):
        name = f"{optimizer}_{layout}"

        def checkpoint(model):
            return tf.train.Checkpoint(model) if layout == "root" else \
                tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        keras.backend.clear_session()
        model = _mixed_dense(keras, optimizer, 4)
        model.fit(x, np.ones((8, 2), np.float32), batch_size=4, epochs=2, verbose=0)
        path = checkpoint(model).save(os.path.join(OUT, "mixed_dense", name, "ckpt"))
        keras.backend.clear_session()
        _mixed_dense(keras, optimizer, 5)                       # names shifted by one model
        fresh = _mixed_dense(keras, optimizer, 77)
        status = checkpoint(fresh).restore(path)
        fresh.optimizer.build(fresh.trainable_variables)        # slots made after the restore
        status.assert_existing_objects_matched()
        report[f"mixed_dense/{name}"] = {
            "prefix": os.path.basename(path), "optimizer": type(fresh.optimizer).__name__,
            "restored": _variables_json(list(fresh.weights) + list(fresh.optimizer.variables))}


def keras_square_shifted(report: dict) -> None:
    import keras
    keras.backend.clear_session()
    keras.layers.Dense(7)                                       # one more layer, made first
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(3)])
    tf.train.Checkpoint(model=model).restore(os.path.join(OUT, "keras_square", "ckpt")) \
        .assert_nontrivial_match()
    report["keras_square/shifted"] = _variables_json(model.weights)


def guide_restored(report: dict) -> None:
    import keras

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.l1 = keras.layers.Dense(5)

        def call(self, x):
            return self.l1(x)

    keras.backend.clear_session()
    keras.utils.set_random_seed(6)
    inputs = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    dataset = tf.data.Dataset.from_tensor_slices(
        {"x": inputs, "y": inputs[:, :1] * 3}).repeat(10).batch(2)
    net, optimizer = Net(), keras.optimizers.Adam(0.1)
    ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=optimizer, net=net,
                               iterator=iter(dataset))
    net(inputs[:2])                  # built before the restore (see the module's notes)
    optimizer.build(net.trainable_variables)
    ckpt.restore(tf.train.latest_checkpoint(os.path.join(OUT, "guide"))).assert_consumed()
    report["guide/restored"] = {"step": int(ckpt.step.numpy()),
                                "restored": _variables_json(net.weights + optimizer.variables)}


def big_step(report: dict) -> None:
    import keras
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    optimizer.iterations.assign(2 ** 31 + 5)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(
        os.path.join(OUT, "big_step", "ckpt"))
    report["big_step"] = {"iterations": int(optimizer.iterations.numpy()),
                          "dtype": optimizer.iterations.dtype}


FIXTURES = {"export_cnn": export_cnn, "mixed_dense": mixed_dense,
            "keras_square_shifted": keras_square_shifted, "guide_restored": guide_restored,
            "big_step": big_step}
