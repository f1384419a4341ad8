"""Write tests/data/keras_fit_oracle.json: what TensorFlow 2.21 with Keras 3 gives for
``model.fit`` under ``tf.distribute.MirroredStrategy`` over 1, 2 and 3 logical CPU devices.

Needs TensorFlow, which the tests do not: run it from a separate environment,

    /work/tfvenv/bin/python tests/data/make_keras_fit_oracle.py

Each width runs in a process of its own (two MirroredStrategies of other widths in one
process clash in TensorFlow's collective groups). The JSON holds the data, each model's
initial weights (Keras on JAX initialises other values from the same seed, so the tests set
these) and, per width:

* ``sum``: a Dense(5, tanh, L2 0.01) + Dense(2) model, ``MeanSquaredError(reduction="sum")``
  and ``mae``, SGD(1e-3), 20 rows in batches of 6 (the last batch is 2 rows: at 3 replicas
  1/1/0): the weights and History after one step (``one_step``: rows 0-5) and after two
  epochs (``several``);
* ``batch_norm``: Dense(6) + BatchNormalization + Dense(2), ``mse``, SGD(1e-2), 24 rows in
  batches of 6 (an even split at every width: TensorFlow fails on an uneven first batch, and
  a replica without rows gets NaN statistics), two epochs: the weights TensorFlow reads, each
  replica's own ``moving_mean``/``moving_variance`` (Keras 3 makes them ``MirroredVariable``s
  with aggregation NONE: every replica updates its own copy, and TensorFlow reads and saves
  replica 0's), and History.
"""

import json
import os
import subprocess
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_fit_oracle.json")
WIDTHS = (1, 2, 3)


def _data():
    import numpy as np
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2)) + 0.1).astype(np.float32)
    return x, y


def _models(keras):
    def summed():
        return keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh",
                               kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(2)])

    def normalized():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    return summed, normalized


def _lists(arrays):
    return [a.tolist() for a in arrays]


def one_width(replicas: int) -> dict:
    """The runs at ``replicas`` devices (in this process)."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf
    import keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    x, y = _data()
    summed, normalized = _models(keras)
    keras.utils.set_random_seed(0)
    initial = {"sum": summed().get_weights(), "batch_norm": normalized().get_weights()}
    found = {"sum": {}}

    def compiled_sum():
        with strategy.scope():
            model = summed()
            model.set_weights(initial["sum"])
            model.compile(optimizer=keras.optimizers.SGD(1e-3),
                          loss=keras.losses.MeanSquaredError(reduction="sum"),
                          metrics=["mae"])
        return model

    for run, rows, epochs in (("one_step", 6, 1), ("several", 20, 2)):
        model = compiled_sum()
        history = model.fit(x[:rows], y[:rows], batch_size=6, epochs=epochs, shuffle=False,
                            verbose=0)
        found["sum"][run] = {"weights": _lists(model.get_weights()),
                             "history": history.history}
    with strategy.scope():
        model = normalized()
        model.set_weights(initial["batch_norm"])
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    layer = model.layers[1]
    found["batch_norm"] = {
        "weights": _lists(model.get_weights()),
        "history": history.history,
        "replicas": {name: [c.numpy().tolist() for c in getattr(layer, name).value.values]
                     for name in ("moving_mean", "moving_variance")},
    }
    return {"initial": {k: _lists(v) for k, v in initial.items()}, "found": found,
            "tensorflow": tf.__version__, "keras": keras.__version__}


def main() -> None:
    widths = {}
    for replicas in WIDTHS:
        done = subprocess.run([sys.executable, __file__, "--replicas", str(replicas)],
                              check=True, stdout=subprocess.PIPE, text=True)
        widths[replicas] = json.loads(done.stdout.strip().splitlines()[-1])
    first = widths[WIDTHS[0]]
    assert all(w["initial"] == first["initial"] for w in widths.values())
    x, y = _data()
    oracle = {"tensorflow": first["tensorflow"], "keras": first["keras"],
              "x": x.tolist(), "y": y.tolist(), "initial": first["initial"],
              "widths": {str(r): w["found"] for r, w in widths.items()}}
    with open(OUT, "w") as out:
        json.dump(oracle, out, indent=None, separators=(",", ":"))
        out.write("\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--replicas"]:
        print(json.dumps(one_width(int(sys.argv[2]))))
    else:
        main()
