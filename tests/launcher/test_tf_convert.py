"""``python -m mpistrat convert`` as jobs at 1-3 ranks, and TensorFlow's own reader on what it
wrote: a model trained here loads with ``tf.train.Checkpoint``.

The TensorFlow half needs a Python with TensorFlow 2.21 (never the project's venv): the one
named by MPISTRAT_TEST_TF_PYTHON, else /work/tfvenv/bin/python; without it that half is
skipped with the reason (as in CI), the conversions themselves are still checked."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tf"

JOB = """
import os, sys, numpy as np, mpistrat as ms
from mpistrat.convert import main as convert
from mpistrat.runtime import get_world
source, out = sys.argv[1], sys.argv[2]
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
"""

TF_CHECK = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
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
print("tensorflow accepted", len(checks["round_trips"]) + len(checks["trained"]))
"""


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
    round_trips, trained = [], []
    for ranks in (1, 2, 3):
        out = tmp_path / f"np{ranks}"
        job = launch(ranks, JOB, str(DATA / "module/ckpt-2"), str(out), limit=240)
        assert job.returncode == 0, job
        exits = [line.split()[1] for line in job.output.splitlines() if line.startswith("exit")]
        assert sorted(exits) == sorted(["0", "0", "1", "0"] * ranks), job
        assert "skipped model/words (strings)" in job.output        # bfloat16 converted
        assert "cannot hold model/words (strings)" in job.output
        shards = sorted(n for n in os.listdir(out / "tf") if ".data-" in n)
        assert shards == [f"ckpt-2.data-{r:05d}-of-{ranks:05d}" for r in range(ranks)]
        round_trips.append((str(out / "tf" / "ckpt-2"), "module/ckpt-2"))
        trained.append((str(out / "trained-tf" / "ckpt-1"), str(out / "expected.npz")))
    python, why = tensorflow_python()
    if python is None:
        pytest.skip(f"conversions checked; TensorFlow's reader not run: {why}")
    checks = json.dumps({"round_trips": round_trips, "trained": trained})
    done = subprocess.run([python, "-c", TF_CHECK, str(ROOT / "tests" / "data"), checks],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith(
                              ("OMPI_", "PMIX_", "PRTE_", "PYTHONPATH"))})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tensorflow accepted 6" in done.stdout
