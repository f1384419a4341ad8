"""The main job (jobs/train.py) under mpirun: the same model at any rank count for one global
batch, and a run SIGKILLed mid-epoch that resumes to the same model as an uninterrupted one."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import MPIRUN, ROOT, descendants

JOB = str(ROOT / "jobs" / "train.py")
FLAGS = ["--epochs", "2", "--global-batch", "64"]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
    return env


def _command(ranks, data, ckpt, *extra, limit=240):
    return [str(MPIRUN), "--limit", str(limit), "-n", str(ranks), sys.executable, JOB,
            "--data", str(data), "--checkpoint-dir", str(ckpt), *FLAGS, *extra]


def _run(ranks, data, ckpt, *extra):
    done = subprocess.run(_command(ranks, data, ckpt, *extra), env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = done.stdout.replace("\r", "\n")
    assert done.returncode == 0, output[-4000:]
    return output


def _latest(ckpt: Path) -> Path:
    text = (ckpt / "checkpoint").read_text()
    name = re.search(r'^model_checkpoint_path: "([^"]+)"', text, re.M).group(1)
    return ckpt / f"{name}.h5"


def _model(ckpt: Path) -> dict:
    """The trained parameters, read with plain h5py (no mpistrat)."""
    values = {}
    with h5py.File(_latest(ckpt), "r") as f:
        f["model"].visititems(lambda name, obj: values.__setitem__(name, obj[()])
                              if isinstance(obj, h5py.Dataset) else None)
    assert set(values) == {"hidden/kernel", "hidden/bias", "output/kernel", "output/bias"}
    return values


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("digits")


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted run at 2 ranks: its output and checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("reference")
    return _run(2, data, ckpt), ckpt


def test_job_trains_prints_and_plots(reference):
    output, ckpt = reference
    assert "2 replicas (MultiWorkerMirroredStrategy, numpy), 1437 training rows" in output
    assert "[rank" not in output                # other ranks are quiet unless asked
    assert len(re.findall(r"^epoch +\d+/2 +loss [0-9.]+ +accuracy [0-9.]+", output, re.M)) == 2
    accuracy = float(re.search(r"^test accuracy: (0\.\d{3})$", output, re.M).group(1))
    assert accuracy >= 0.85, output            # two epochs only; make run's 15 reach 0.97
    assert f"checkpoints: {ckpt}" in output
    png = ckpt / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"curves: {png}" in output
    with h5py.File(_latest(ckpt), "r") as f:
        assert int(f["epoch"][()]) == 2 and int(f["iterator/steps"][()]) == 0
        assert int(f["preemption/total_run_calls"][()]) == 2 * 23
        assert len(f["history/test_accuracy"]) == 2


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_same_global_batch_gives_the_same_model_at_any_rank_count(data, reference, ranks,
                                                                  tmp_path):
    output = _run(ranks, data, tmp_path, "--all-ranks")
    expected, got = _model(reference[1]), _model(tmp_path)
    # each rank read only its own rows of every batch (MPI-IO, DATA sharding): together, the
    # training file's rows exactly once per epoch
    read = {}
    # (not anchored at a line start: rank 0's progress bar may precede a line on the same one)
    for rank, count in re.findall(r"\[rank (\d+)\] read ([\d,]+) bytes", output):
        read[rank] = max(read.get(rank, 0), int(count.replace(",", "")))
    assert len(read) == ranks and sum(read.values()) == 2 * 1437 * 65 * 4, read
    assert max(read.values()) <= 2 * 1437 * 65 * 4 / ranks + 2 * 23 * 65 * 4, read
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=2e-4, atol=2e-5,
                                   err_msg=f"{name} at {ranks} ranks vs 2 ranks")


def test_sigkill_mid_epoch_then_restart_ends_with_the_same_model(data, reference, tmp_path):
    job = subprocess.Popen(_command(2, data, tmp_path, "--checkpoint-every", "3"), env=_env(),
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            state = tmp_path / "checkpoint"      # ckpt-2: six steps into the first epoch
            if state.exists() and "ckpt-2\"" in state.read_text().split("\n")[0]:
                break
            time.sleep(0.02)
        ranks = [p for _, p in descendants(job.pid)
                 if "train.py" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert ranks, "no rank process found under mpirun"
        os.kill(ranks[-1], signal.SIGKILL)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0, output[-3000:]
    assert "test accuracy:" not in output, "the job finished before it was killed"
    with h5py.File(_latest(tmp_path), "r") as f:
        position = int(f["iterator/steps"][()])
        run_calls = int(f["preemption/total_run_calls"][()])
    assert 0 < run_calls < 2 * 23 and position == run_calls % 23 and position > 0

    resumed = _run(2, data, tmp_path, "--checkpoint-every", "3")
    assert re.search(rf"^resumed from .*ckpt-\d+: epoch \d, step {position} of 23$", resumed,
                     re.M), resumed
    expected, got = _model(reference[1]), _model(tmp_path)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7,
                                   err_msg=f"{name} after the restart")


def test_make_run_defaults_reach_095_and_a_second_run_has_nothing_to_do(data, tmp_path):
    command = [str(MPIRUN), "--limit", "240", "-n", "2", sys.executable, JOB, "--data",
               str(data), "--checkpoint-dir", str(tmp_path)]     # make run's flags: defaults
    first = subprocess.run(command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    assert first.returncode == 0, first.stdout[-3000:]
    accuracy = float(re.search(r"^test accuracy: (0\.\d{3})$", first.stdout, re.M).group(1))
    assert accuracy >= 0.95, first.stdout[-3000:]
    second = subprocess.run(command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "has finished 15 epochs already: nothing to train" in second.stdout
    assert f"test accuracy: {accuracy:.3f}" in second.stdout


def test_bad_data_stops_every_rank_with_one_named_cause(data, reference, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.npy").write_bytes((data / "train.npy").read_bytes())
    done = subprocess.run(_command(2, tmp_path / "data", tmp_path / "ckpt"), env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode not in (0, 124), done.stdout[-3000:]
    assert done.stdout.count("has train.npy but no test.npy") == 2, done.stdout[-3000:]
    assert "Traceback" not in done.stdout
    assert not (tmp_path / "data" / "test.npy").exists()   # nothing written over the user's data
    np.save(tmp_path / "data" / "test.npy", np.zeros((4, 9), np.float32))
    done = subprocess.run(_command(2, tmp_path / "data", tmp_path / "ckpt"), env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode not in (0, 124)
    assert done.stdout.count("has 64 feature columns but") == 2, done.stdout[-3000:]


def test_deterministic_flag_trains_with_reproducible_sums(data, reference, tmp_path):
    done = subprocess.run(_command(2, data, tmp_path, "--deterministic"), env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "test accuracy:" in done.stdout


def test_tpu_replicas_train_every_jax_device_and_resume(data, reference, tmp_path):
    env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    first = subprocess.run(_command(2, data, tmp_path, "--replicas", "tpu", "--epochs", "1"),
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    assert first.returncode == 0, first.stdout[-3000:]
    # static shapes: 1437 rows make 22 full batches of 64, 8 rows per device
    assert "8 replicas (TPUStrategy, tpu), 1437 training rows, global batch 64, 22 steps" \
        in first.stdout, first.stdout[-3000:]
    assert re.search(r"^test accuracy: 0\.\d{3}$", first.stdout, re.M)
    with h5py.File(_latest(tmp_path), "r") as f:
        assert int(f["preemption/total_run_calls"][()]) == 22
    second = subprocess.run(_command(1, data, tmp_path, "--replicas", "tpu"), env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert second.returncode == 0, second.stdout[-3000:]      # a second epoch on 4 replicas
    assert "resumed from" in second.stdout and "epoch   2/2" in second.stdout, second.stdout
