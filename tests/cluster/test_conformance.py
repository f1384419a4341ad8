"""The single-host multi-rank suites run across real hosts: the same assertions on reduce,
gather, variables, datasets, readers and checkpoints (tests/mpi), and on TPUStrategy
(tests/tpu, each rank a JAX host with 4 virtual CPU devices), with ranks on several hosts.

Each case runs pytest on every rank (scripts/rank_pytest.py) through mpirun over the agent
or srun. MirroredStrategy's cases are deselected: across hosts it refuses to start (tested
in test_runtime.py). When MPISTRAT_TEST_LOGS is set (scripts/test.sh), rank 0's log goes
there as cluster-LAUNCHER-LAYOUT.rank0.log, so the suite's summary counts these tests.
"""

import os
import re
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(600)
# MirroredStrategy refuses to start across hosts (test_runtime.py); Keras (fit, custom loops,
# SyncBatchNormalization), framework checkpoints and Horovod's Keras loops, API and messages
# exercise framework code over collectives and checkpoints that the other cases already run
# across hosts (and would take most of this suite's time there); Horovod's collective rules
# (test_horovod_rules.py) do run across hosts.
SKIP_ACROSS_HOSTS = ("not mirrored and not keras and not checkpoint_frameworks and not "
                     "horovod_loops and not horovod_api and not horovod_messages")


@pytest.mark.parametrize("suite,launcher,layout,least", [
    ("mpi", "mpirun", "2x2", 60), ("mpi", "srun", "3x1", 60), ("tpu", "mpirun", "2x1", 36)])
def test_suite_across_hosts(cluster, tmp_path, suite, launcher, layout, least):
    logs = Path(os.environ.get("MPISTRAT_TEST_LOGS") or tmp_path)
    prefix = logs / f"cluster-{suite}-{launcher}-{layout}"
    argv = [sys.executable, str(ROOT / "scripts" / "rank_pytest.py"), str(prefix), "-q",
            "--color=no", "-p", "no:cacheprovider", "--timeout=180", "--timeout-method=thread",
            *(["-k", SKIP_ACROSS_HOSTS] if suite == "mpi" else []), str(ROOT / "tests" / suite)]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"} if suite == "tpu" else None
    result = cluster.launch(launcher, layout, argv, cwd=ROOT, limit=480, env=env)
    output = "\n".join(line for line in result.output.splitlines()
                       if not line.startswith("[Gloo]"))   # JAX's connection chatter
    Path(f"{prefix}.rank0.log").write_text(output)
    assert result.returncode == 0, result
    summary = [line for line in output.splitlines()
               if re.search(r"\d+ passed.* in [0-9.]+s", line)]
    assert summary, result
    assert not re.search(r"\d+ (failed|errors?)", summary[-1]), summary[-1]
    assert int(re.search(r"(\d+) passed", summary[-1]).group(1)) >= least, summary[-1]
