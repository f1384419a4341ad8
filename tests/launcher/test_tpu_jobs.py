"""Launcher tests of the JAX bridge: a TPUStrategy job that trains, checkpoints and
resumes at another size, and start-up errors that every rank must report."""

import re
import shutil

from conftest import ROOT

FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _job(tmp_path):
    path = tmp_path / "tpu_train.py"
    shutil.copy(ROOT / "jobs" / "tpu_train.py", path)
    return path.read_text()


def test_tpu_job_trains_and_resumes_at_another_size(launch, tmp_path):
    script = _job(tmp_path)
    run_dir = str(tmp_path / "run")
    first = launch(2, script, "--dir", run_dir, "--epochs", "2", limit=180, env=FOUR_DEVICES)
    assert first.returncode == 0, first
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", first.output)]
    assert len(losses) == 2 and losses[1] < 0.2 * losses[0], first
    assert "hosts 2 x 4 cpu devices, resumed=False" in first.output, first
    assert "step 16," in first.output, first      # 512 rows / (8 per replica x 8 replicas) x 2
    second = launch(1, script, "--dir", run_dir, "--epochs", "1", limit=180, env=FOUR_DEVICES)
    assert second.returncode == 0, second
    assert "hosts 1 x 4 cpu devices, resumed=True" in second.output, second
    assert "step 32," in second.output, second    # the step counter came back from ckpt-2
    (loss,) = [float(x) for x in re.findall(r"loss ([0-9.]+)", second.output)]
    assert loss < losses[1], second
    weights = [float(x) for x in re.search(r"final w \[([^\]]+)\]", second.output)
               .group(1).split(",")]
    assert abs(weights[0] + 1.0) < 0.05 and abs(weights[-1] - 1.0) < 0.05, second


START_AND_REPORT = """
try:
    ms.TPUStrategy()
except ms.errors.InvalidArgumentError as err:
    say("caught:", err)
    raise SystemExit(3)
say("unreachable")
"""

JAX_FIRST = """
import jax.numpy as jnp
import mpistrat as ms
jnp.zeros(3).block_until_ready()        # JAX starts here, before the bridge
""" + START_AND_REPORT


def test_jax_used_before_the_bridge_is_reported_on_every_rank(launch):
    result = launch(2, JAX_FIRST, limit=90, env=FOUR_DEVICES)
    assert result.returncode not in (0, 124), result
    assert result.output.count("caught:") == 2, result
    assert "rank 0: JAX was used before the bridge started" in result.output, result
    assert "rank 1: JAX was used before the bridge started" in result.output, result
    assert "unreachable" not in result.output


UNEVEN_DEVICES = """
import os
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 + rank}"
import mpistrat as ms
""" + START_AND_REPORT


def test_hosts_with_different_device_counts_are_refused_on_every_rank(launch):
    result = launch(2, UNEVEN_DEVICES, limit=90)
    assert result.returncode not in (0, 124), result
    assert result.output.count("caught:") == 2, result
    assert "same number of devices" in result.output, result
    assert "rank 0: 2, rank 1: 3" in result.output, result
