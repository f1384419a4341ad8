"""A Keras 3 model (JAX backend here) matched to a TensorFlow Keras checkpoint by its
variables' paths, which TensorFlow records as each value's full_name: the model's weights and
the Adam state restore bit for bit as TensorFlow 2.21 reported them, whatever object paths
our checkpoint gives the variables."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

from mpistrat.checkpoint.graph import Slot  # noqa: E402
from mpistrat.checkpoint.tf_checkpoints import TensorFlowValues, read_graph  # noqa: E402
from mpistrat.tfformats import bundle  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())


def test_keras_variables_restore_by_their_paths():
    keras.backend.clear_session()   # the same automatic names as in the fixture's program
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    variables = list(model.weights) + list(optimizer.variables)
    slots = {f"anything/{i}": Slot(f"anything/{i}", "variable", v.numpy, v.assign, v)
             for i, v in enumerate(variables)}
    index = bundle.read_index(str(DATA / "keras/ckpt-1"))
    values = TensorFlowValues(index, read_graph(index))
    found = values.match(slots)
    assert sorted(found) == sorted(slots)          # every variable found, none by its path
    for path, target in found.items():
        slots[path].write(bundle.read_value(values.entry(target)))
    expected = {**REPORT["keras/weights"], **REPORT["keras/optimizer"]}
    for variable in variables:
        want = expected[variable.path]
        value = np.asarray(variable.numpy())
        assert list(value.shape) == want["shape"], variable.path
        if variable.path == "adam/iteration":  # int64 in TensorFlow, int32 in JAX without x64
            assert int(value) == int.from_bytes(bytes.fromhex(want["hex"]), "little") == 1
        else:
            assert value.tobytes().hex() == want["hex"], variable.path
