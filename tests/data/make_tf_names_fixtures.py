"""Write the TensorFlow fixtures under tests/data/tf/names/ with real TensorFlow (2.21).

Needs TensorFlow, which the tests do not: run it from a separate environment,

    /work/tfvenv/bin/python tests/data/make_tf_names_fixtures.py

It writes, beside a JSON of what TensorFlow itself read back (``names.json``: per checkpoint,
every key with its dtype, shape and bytes as hex):

* ``unicode/``: a ``tf.Module`` tree whose attributes and dict keys are not ASCII (``café``,
  ``重み``, ``naïve``, ``ключ``), which TensorFlow keeps as UTF-8 in the keys and the object
  graph, saved with ``Checkpoint.write``;
* ``tf1/``: a TF1 graph's variables (``dense/kernel``, ``dense/bias``, an int64
  ``global_step``) saved by ``tf.compat.v1.train.Saver``: TF1 names, no object graph.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf", "names")


def report(prefix: str) -> dict:
    reader = tf.train.load_checkpoint(prefix)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    out = {}
    for key in sorted(shapes):
        value = np.asarray(reader.get_tensor(key))
        data = value.tobytes() if value.dtype != object else b"".join(
            bytes(v) for v in value.reshape(-1))
        out[key] = {"dtype": dtypes[key].name, "shape": list(shapes[key]), "hex": data.hex()}
    return out


def unicode_module() -> tf.Module:
    """The module the unicode fixture saves (the tests' TensorFlow check builds it again)."""
    root = tf.Module()
    setattr(root, "café", tf.Variable(np.array([1.5, -2.0, 3.25], np.float32)))
    setattr(root, "重み", tf.Variable(np.arange(6, dtype=np.int32).reshape(2, 3)))
    inner = tf.Module()
    setattr(inner, "naïve", tf.Variable(np.float64(0.125)))
    root.sub = inner
    root.table = {"ключ": tf.Variable(np.array([7, 8], np.int64)), "plain": tf.Variable(2.5)}
    return root


def tf1_graph():
    """A TF1 graph of three variables and its Saver."""
    graph = tf.Graph()
    with graph.as_default():
        init = tf.compat.v1.random_uniform_initializer(-1.0, 1.0, seed=11)
        tf.compat.v1.get_variable("dense/kernel", shape=[3, 2], initializer=init)
        tf.compat.v1.get_variable("dense/bias", initializer=np.array([0.5, -0.5], np.float32))
        tf.compat.v1.get_variable("global_step", initializer=np.int64(12345))
        saver = tf.compat.v1.train.Saver()
    return graph, saver


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    out = {"tensorflow": tf.__version__}
    path = tf.train.Checkpoint(model=unicode_module()).write(os.path.join(OUT, "unicode", "ckpt"))
    out["unicode/ckpt"] = report(path)
    graph, saver = tf1_graph()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        path = saver.save(session, os.path.join(OUT, "tf1", "model.ckpt"),
                          write_meta_graph=False)
    out["tf1/model.ckpt"] = report(path)
    with open(os.path.join(OUT, "names.json"), "w") as handle:
        json.dump(out, handle, sort_keys=True, indent=1, ensure_ascii=False)
        handle.write("\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
