"""The single-host multi-rank suite (tests/mpi) run across real hosts: the same assertions
on reduce, gather, variables, datasets, readers and checkpoints, with ranks on several hosts.

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


@pytest.mark.parametrize("launcher,layout", [("mpirun", "2x2"), ("srun", "3x1")])
def test_mpi_suite_across_hosts(cluster, tmp_path, launcher, layout):
    logs = Path(os.environ.get("MPISTRAT_TEST_LOGS") or tmp_path)
    prefix = logs / f"cluster-{launcher}-{layout}"
    argv = [sys.executable, str(ROOT / "scripts" / "rank_pytest.py"), str(prefix), "-q",
            "--color=no", "-p", "no:cacheprovider", "--timeout=120", "--timeout-method=thread",
            "-k", "not mirrored", str(ROOT / "tests" / "mpi")]
    result = cluster.launch(launcher, layout, argv, cwd=ROOT, limit=480)
    Path(f"{prefix}.rank0.log").write_text(result.output)
    assert result.returncode == 0, result
    summary = [line for line in result.output.splitlines()
               if re.search(r"\d+ passed.* in [0-9.]+s", line)]
    assert summary, result
    assert not re.search(r"\d+ (failed|errors?)", summary[-1]), summary[-1]
    assert int(re.search(r"(\d+) passed", summary[-1]).group(1)) >= 60, summary[-1]
