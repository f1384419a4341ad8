"""``python -m mpistrat convert`` as jobs at 1-3 ranks, and TensorFlow's own reader on what it
wrote: a model trained here loads with ``tf.train.Checkpoint``; TensorFlow -> ours ->
TensorFlow gives back the original keys, dtypes, shapes, bytes and object graph, which
TensorFlow restores into the original objects (TF1's ``Saver`` included, and names that are
not ASCII).

The TensorFlow half needs a Python with TensorFlow 2.21 (never the project's venv): the one
named by MPISTRAT_TEST_TF_PYTHON, else /work/tfvenv/bin/python; without it that half is
skipped with the reason (as in CI), the conversions themselves are still checked."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tf"

JOB = """
import os, sys, numpy as np, mpistrat as ms
from mpistrat.convert import main as convert
from mpistrat.runtime import get_world
source, out = sys.argv[1], sys.argv[2]
data = os.path.dirname(os.path.dirname(source))
# a TensorFlow checkpoint to ours and back
say("exit", convert([source, out + "/ours/ckpt-2", "--skip-unsupported"]))
say("exit", convert([out + "/ours/ckpt-2", out + "/tf/ckpt-2"]))
say("exit", convert([source, out + "/refused/ckpt-2"]))       # strings: refused, named
# a model trained here, saved by ms.Checkpoint, converted for TensorFlow
strategy = ms.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(7)
with strategy.scope():
    dense = {"kernel": ms.Variable(rng.standard_normal((3, 4)).astype(np.float32)),
             "bias": ms.Variable(rng.standard_normal(4).astype(np.float32))}
    step = ms.Variable(np.int64(41))
class Model: pass
model = Model(); model.dense = dense; model.step = step
model.half = rng.standard_normal(5).astype(np.float16)
ms.Checkpoint(model=model).save(out + "/trained/ckpt")
if get_world().rank == 0:
    np.savez(out + "/expected.npz", kernel=dense["kernel"].numpy(), bias=dense["bias"].numpy(),
             step=step.numpy(), half=model.half)
say("exit", convert([out + "/trained", out + "/trained-tf/ckpt-1"]))
for name in ROUND_TRIPS:                                       # back to the original files
    say("exit", convert([data + "/" + name, out + "/rt/" + name + "/ours"]))
    say("exit", convert([out + "/rt/" + name + "/ours", out + "/rt/" + name + "/tf"]))
"""

ROUND_TRIPS = ["names/tf1/model.ckpt", "names/unicode/ckpt", "sliced/tf1/model.ckpt",
               "keras/ckpt-1"]
JOB = f"ROUND_TRIPS = {ROUND_TRIPS!r}\n" + JOB

TF_CHECK = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np, tensorflow as tf
sys.path.insert(0, sys.argv[1])
from make_tf_fixtures import Net
checks = json.loads(sys.argv[2])
report = json.load(open(os.path.join(sys.argv[1], "tf", "values.json")))
for prefix, original in checks["round_trips"]:       # TF -> ours -> TF: TF's reader agrees
    reader = tf.train.load_checkpoint(prefix)
    for key, want in report[original].items():
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH" or "words" in key:   # (strings: skipped)
            continue
        assert reader.get_tensor(key).tobytes().hex() == want["hex"], (prefix, key)
    net = Net()
    for v in net.variables:
        v.assign(tf.zeros_like(v))
    status = tf.train.Checkpoint(model=net).read(prefix)
    status.expect_partial()
    assert net.dense.kernel.numpy().tobytes().hex() == report[original][
        "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"]["hex"]
    assert int(net.step.numpy()) == -(2 ** 40) - 2
for prefix, expected in checks["trained"]:            # trained here, loaded by TensorFlow
    want = np.load(expected)
    model = tf.Module()
    model.dense = tf.Module()
    model.dense.kernel = tf.Variable(np.zeros((3, 4), np.float32))
    model.dense.bias = tf.Variable(np.zeros(4, np.float32))
    model.step = tf.Variable(np.int64(0))
    model.half = tf.Variable(np.zeros(5, np.float16))
    checkpoint = tf.train.Checkpoint(model=model)
    checkpoint.read(prefix).assert_existing_objects_matched()
    assert np.array_equal(model.dense.kernel.numpy(), want["kernel"])
    assert np.array_equal(model.dense.bias.numpy(), want["bias"])
    assert int(model.step.numpy()) == 41 and np.array_equal(model.half.numpy(), want["half"])
import make_tf_names_fixtures as names
for out in checks["exact"]:                            # restored into the original objects
    graph, saver = names.tf1_graph()
    with tf.compat.v1.Session(graph=graph) as session:
        saver.restore(session, out + "/names/tf1/model.ckpt/tf")
        step = [v for v in graph.get_collection("variables") if v.op.name == "global_step"]
        assert session.run(step[0]) == 12345
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.get_variable("part/emb", shape=[10, 7],
                                  partitioner=tf.compat.v1.fixed_size_partitioner(3))
        tf.compat.v1.get_variable("part/cols", shape=[4, 9], dtype=tf.float64,
                                  partitioner=tf.compat.v1.fixed_size_partitioner(2, axis=1))
        tf.compat.v1.get_variable("plain", shape=[3], dtype=tf.int32)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as session:
            saver.restore(session, out + "/sliced/tf1/model.ckpt/tf")
            plain = [v for v in tf.compat.v1.global_variables() if v.op.name == "plain"]
            assert session.run(plain[0]).tolist() == [7, 8, 9]
    module = names.unicode_module()
    for v in module.variables:
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(model=module).read(out + "/names/unicode/ckpt/tf").assert_consumed()
    assert getattr(module, "café").numpy().tolist() == [1.5, -2.0, 3.25]
    assert module.table["ключ"].numpy().tolist() == [7, 8]
    import keras
    keras.backend.clear_session()   # the fixture's automatic names, for each file checked
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        out + "/keras/ckpt-1/tf").assert_existing_objects_matched()
    for w in model.weights:
        assert w.numpy().tobytes().hex() == report["keras/weights"][w.path]["hex"], w.path
    for v in optimizer.variables:
        assert v.numpy().tobytes().hex() == report["keras/optimizer"][v.path]["hex"], v.path
print("tensorflow accepted", len(checks["round_trips"]) + len(checks["trained"]),
      "and restored", len(checks["exact"]))
"""


def _table(prefix):
    """Every key of a TensorFlow checkpoint: dtype, shape and bytes, as our reader gives."""
    import mpistrat as ms
    reader = ms.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    return {key: (str(dtypes[key]), shape, np.asarray(reader.get_tensor(key)).tobytes())
            for key, shape in reader.get_variable_to_shape_map().items()}


def tensorflow_python():
    python = os.environ.get("MPISTRAT_TEST_TF_PYTHON", "/work/tfvenv/bin/python")
    if not os.path.exists(python):
        return None, f"no Python with TensorFlow at {python} (set MPISTRAT_TEST_TF_PYTHON)"
    probe = subprocess.run([python, "-c", "import tensorflow"], capture_output=True,
                           timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if probe.returncode != 0:
        return None, f"TensorFlow is not importable by {python}"
    return python, ""


def test_convert_round_trips_and_tensorflow_reads_them(launch, tmp_path):
    round_trips, trained, exact = [], [], []
    for ranks in (1, 2, 3):
        out = tmp_path / f"np{ranks}"
        job = launch(ranks, JOB, str(DATA / "module/ckpt-2"), str(out), limit=240)
        assert job.returncode == 0, job
        exits = [line.split()[1] for line in job.output.splitlines() if line.startswith("exit")]
        assert sorted(exits) == sorted(["0", "0", "1", "0"] * ranks + ["0", "0"] * len(
            ROUND_TRIPS) * ranks), job
        key = "model/words/.ATTRIBUTES/VARIABLE_VALUE"
        assert f"skipped 1: {key} (strings)" in job.output        # bfloat16 converted
        assert f"cannot hold {key} (strings)" in job.output
        for name in ROUND_TRIPS:     # keys, dtypes, shapes, bytes and graph: the original's
            assert _table(str(out / "rt" / name / "tf")) == _table(str(DATA / name)), name
        exact.append(str(out / "rt"))
        shards = sorted(n for n in os.listdir(out / "tf") if ".data-" in n)
        assert shards == [f"ckpt-2.data-{r:05d}-of-{ranks:05d}" for r in range(ranks)]
        round_trips.append((str(out / "tf" / "ckpt-2"), "module/ckpt-2"))
        trained.append((str(out / "trained-tf" / "ckpt-1"), str(out / "expected.npz")))
    python, why = tensorflow_python()
    if python is None:
        pytest.skip(f"conversions checked; TensorFlow's reader not run: {why}")
    checks = json.dumps({"round_trips": round_trips, "trained": trained, "exact": exact})
    done = subprocess.run([python, "-c", TF_CHECK, str(ROOT / "tests" / "data"), checks],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith(
                              ("OMPI_", "PMIX_", "PRTE_", "PYTHONPATH"))})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tensorflow accepted 6 and restored 3" in done.stdout
