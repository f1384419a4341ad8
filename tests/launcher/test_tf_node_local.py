"""TensorFlow files that one rank sees differently (a private mount namespace for rank 1,
as node-local copies would): every rank raises the same DataLossError, naming what each
rank saw, before any value is read; nobody hangs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MPIRUN, PRELUDE

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")

JOB = """
import sys, numpy as np, mpistrat as ms
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "checkpoint":
        ms.Checkpoint(model={"dense": {"kernel": np.zeros((3, 4), np.float32)}}).restore(path)
    else:
        strategy = ms.MultiWorkerMirroredStrategy()
        options = ms.data.Options()
        options.experimental_distribute.auto_shard_policy = ms.data.AutoShardPolicy.DATA
        dataset = ms.data.TFRecordDataset([path]).batch(2).with_options(options)
        for _ in strategy.experimental_distribute_dataset(dataset):
            pass
    say("no error")
except Exception as err:
    say("error", type(err).__name__, str(err).replace("\\n", " "))
"""


def run_with_rank1_seeing(tmp_path, kind, path, original, replacement):
    """Rank 0 sees ``original``; rank 1, in its own mount namespace, ``replacement`` there."""
    job = tmp_path / "job.py"
    job.write_text(PRELUDE + JOB)
    private = (f"mount --bind {replacement} {original} && "
               f"exec {sys.executable} {job} {kind} {path}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    done = subprocess.run([str(MPIRUN), "--limit", "90", "-n", "1", sys.executable, str(job),
                           kind, str(path), ":", "-n", "1", "unshare", "--mount",
                           "--propagation", "private", "sh", "-c", private],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    errors = [line for line in done.stdout.splitlines() if line.startswith("error ")]
    assert done.returncode == 0 and len(errors) == 2, done.stdout
    assert errors[0] == errors[1], errors   # the same error on both ranks
    return errors[0]


@ROOT_ONLY
@pytest.mark.parametrize("defect", ["another index", "a truncated shard"])
def test_a_checkpoint_one_rank_sees_differently(tmp_path, defect):
    if not shutil.which("unshare"):
        pytest.skip("unshare is missing")
    shutil.copytree(DATA / "module", tmp_path / "m")
    prefix = tmp_path / "m" / "ckpt-1"
    if defect == "another index":
        original, replacement = f"{prefix}.index", DATA / "module" / "ckpt-2.index"
        text = "DataLossError ranks see different things"
    else:
        original = f"{prefix}.data-00000-of-00001"
        replacement = tmp_path / "short"
        replacement.write_bytes(open(original, "rb").read()[:100])
        text = "DataLossError reading"
    error = run_with_rank1_seeing(tmp_path, "checkpoint", prefix, original, replacement)
    assert error.startswith(f"error {text}"), error
    if defect == "a truncated shard":
        assert "rank 1: DataLossError" in error and "beyond the end" in error


@ROOT_ONLY
def test_a_record_file_one_rank_sees_differently(tmp_path):
    if not shutil.which("unshare"):
        pytest.skip("unshare is missing")
    path = tmp_path / "a.tfrecord"
    shutil.copy(DATA / "records" / "plain-0.tfrecord", path)
    replacement = tmp_path / "other"
    shutil.copy(DATA / "records" / "plain-1.tfrecord", replacement)
    error = run_with_rank1_seeing(tmp_path, "records", path, path, replacement)
    assert error.startswith("error InvalidArgumentError ranks see different things"), error
    assert "every rank must read the same files" in error and str(path) in error
