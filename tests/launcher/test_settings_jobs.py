"""Launcher tests: a bad MPISTRAT_* value, on every rank or on one rank only, is refused on
every rank with an error naming the variable, the value and the rank, never a hang."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import MPIRUN, PRELUDE, ROOT

JOB = """
import mpistrat as ms
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
try:
    strategy = ms.MultiWorkerMirroredStrategy()
    say("rank", rank, "sum", strategy.reduce("SUM", 1.0, axis=None))
except ValueError as err:
    say("rank", rank, "caught", type(err).__name__, err)
"""


def launch_mpmd(tmp_path, parts, script, limit=60):
    """``scripts/mpirun -n 1 python job.py : -n 1 env VAR=... python job.py``: one rank per
    entry of ``parts`` (a dict of variables for that rank)."""
    path = tmp_path / "job.py"
    path.write_text(PRELUDE + script)
    command = [str(MPIRUN), "--limit", str(limit)]
    for index, extra in enumerate(parts):
        if index:
            command.append(":")
        command += ["-n", "1", "env", *(f"{k}={v}" for k, v in extra.items()),
                    sys.executable, str(path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env = {k: v for k, v in env.items() if not k.startswith("MPISTRAT_") or k == "MPISTRAT_MPI"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT)   # the mpistrat of this checkout
    start = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout, time.monotonic() - start


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_bad_value_on_one_rank_only_is_raised_on_every_rank(tmp_path, nprocs):
    bad = {"MPISTRAT_COLLECTIVE_TIMEOUT": "abc",     # read when an engine is made
           "MPISTRAT_BUFFER_POOL_BYTES": "-1"}      # read while mpistrat is imported
    code, output, seconds = launch_mpmd(tmp_path, [{}] * (nprocs - 1) + [bad], JOB)
    assert code == 0, output
    assert seconds < 40, output
    assert "sum" not in output, output
    last = nprocs - 1
    for rank in range(nprocs):
        lines = [line for line in output.splitlines() if line.startswith(f"rank {rank} caught")]
        assert len(lines) == 1, output
        line = lines[0]
        assert "SettingError" in line and f"on rank {last} (" in line, line
        assert "MPISTRAT_COLLECTIVE_TIMEOUT='abc': expected a number of seconds above 0" in line
        assert "MPISTRAT_BUFFER_POOL_BYTES='-1': expected a byte count >= 0" in line, line
        assert "on rank 0" not in line, line


def test_an_uncaught_bad_value_ends_the_job_with_the_named_error(tmp_path):
    code, output, seconds = launch_mpmd(
        tmp_path, [{"MPISTRAT_VALIDATE": "maybe"}] * 2,
        "import mpistrat as ms\nms.MultiWorkerMirroredStrategy()\nsay('unreachable')\n")
    assert code not in (0, 124), output
    assert seconds < 40, output
    assert "unreachable" not in output
    assert "MPISTRAT_VALIDATE='maybe': expected a boolean: 1, true, yes, on or 0, false" in output


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_that_differ_on_a_setting_that_steers_mpi_calls_are_refused_together(tmp_path,
                                                                                    nprocs):
    """MPISTRAT_VALIDATE=0 on one rank only: that rank would skip the probe the others wait
    in. Every rank raises when the world is made, naming the variable and who has what."""
    code, output, seconds = launch_mpmd(
        tmp_path, [{}] * (nprocs - 1) + [{"MPISTRAT_VALIDATE": "0"}], JOB)
    assert code == 0, output
    assert seconds < 40, output
    assert "sum" not in output, output
    others = "rank 0" if nprocs == 2 else "ranks 0, 1"
    for rank in range(nprocs):
        lines = [line for line in output.splitlines() if line.startswith(f"rank {rank} caught")]
        assert len(lines) == 1, output
        assert "SettingError" in lines[0] and "MPISTRAT_VALIDATE differs between ranks: " \
            f"{others} ha" in lines[0] and f"rank {nprocs - 1} has False" in lines[0], lines[0]
    # the same value spelled two ways is the same value
    code, output, _ = launch_mpmd(tmp_path, [{"MPISTRAT_VALIDATE": "off"}] * (nprocs - 1) +
                                  [{"MPISTRAT_VALIDATE": "0"}], JOB)
    assert code == 0 and output.count(f"sum {float(nprocs)}") == nprocs, output
