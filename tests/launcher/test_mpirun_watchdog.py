"""scripts/mpirun's watchdog: an Open MPI mpirun that outlives all of its ranks (Open MPI 4.1's
mpirun can deadlock after an MPI_Abort meets a rank's normal exit) is killed with a line naming
it, the job's output kept; a job that ends normally is left alone, and a bad setting is
refused by name. The deadlock cannot be made on demand: here the real mpirun is stopped
(SIGSTOP) while its rank runs, so it outlives the rank and makes no progress, as a deadlocked
one does."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import MPIRUN, ROOT

pytestmark = pytest.mark.skipif(os.environ.get("MPISTRAT_MPI", "openmpi") != "openmpi",
                                reason="the watchdog watches Open MPI's mpirun")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _mpirun_child(pid, deadline):
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-P", str(pid), "-x", "mpirun.openmpi"],
                               capture_output=True, text=True).stdout.split()
        if found:
            return int(found[0])
        time.sleep(0.05)
    raise AssertionError("no mpirun.openmpi started")


def test_an_mpirun_that_outlives_its_ranks_is_killed_and_named_and_the_output_kept():
    start = time.monotonic()
    proc = subprocess.Popen([str(MPIRUN), "--limit", "60", "-n", "1", sys.executable, "-c",
                             "import time; print('rank says hello', flush=True); time.sleep(3)"],
                            env=_env(MPISTRAT_MPIRUN_ORPHAN_SECONDS="2"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mpirun = _mpirun_child(proc.pid, start + 30)
    first = ""                           # until the rank has started and printed (a fixed
    while "rank says hello" not in first:  # sleep here raced a slow start on a loaded machine)
        line = proc.stdout.readline()
        assert line, first
        first += line
    os.kill(mpirun, signal.SIGSTOP)      # mpirun makes no progress from here on
    out = first + proc.communicate(timeout=90)[0]
    seconds = time.monotonic() - start
    assert proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (proc.returncode, out)
    assert f"mpirun.openmpi (pid {mpirun}) outlived all of its ranks by 2 s" in out, out
    assert "rank says hello" in out, out
    assert seconds < 30, f"ended after {seconds:.0f} s, not 2 s after its rank: {out}"


def test_a_normal_job_is_left_alone_and_ends_at_once():
    start = time.monotonic()
    done = subprocess.run([str(MPIRUN), "--limit", "60", "-n", "2", sys.executable, "-c",
                           "print('done')"], env=_env(MPISTRAT_MPIRUN_ORPHAN_SECONDS="1"),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("done") == 2 and "outlived" not in done.stdout, done.stdout
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("value", ["abc", "1e1", "-3"])
def test_a_bad_orphan_setting_is_refused_by_name(value):
    done = subprocess.run([str(MPIRUN), "-n", "1", "true"],
                          env=_env(MPISTRAT_MPIRUN_ORPHAN_SECONDS=value), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert f"MPISTRAT_MPIRUN_ORPHAN_SECONDS is a number of seconds (0: off), not '{value}'" \
        in done.stderr, done.stderr
