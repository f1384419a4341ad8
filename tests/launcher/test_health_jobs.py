"""Launcher tests of the peer health check (runtime/health.py), with real mpirun jobs: a rank
that skips a collective and exits 0, or is SIGKILLed, ends the job with an error naming it on
every other rank, within the bound; a stopped rank, and ranks that finish at different times,
end nothing."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import MPIRUN, PRELUDE, ROOT

GRACE = 1.0   # MPISTRAT_HEALTH_LEAVE_GRACE in these jobs
# Prints a line with this rank's clock, so the test can time the others' reactions.
PRELUDE_T = PRELUDE + ("import time as _time\n"
                       "def stamp(*parts):\n    say(*parts, 'at', repr(_time.time()))\n")


def launch(tmp_path, nprocs, script, *args, env=None, limit=60, mpirun_args=()):
    """Run the job; return (exit code, [(arrival time, line)], seconds)."""
    path = tmp_path / "job.py"
    path.write_text(PRELUDE_T + script)
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "MPISTRAT_")) or k == "MPISTRAT_MPI"}
    full_env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
                     "MPISTRAT_HEALTH_LEAVE_GRACE": str(GRACE)}, **(env or {}))
    start = time.time()
    proc = subprocess.Popen([str(MPIRUN), "--limit", str(limit), *mpirun_args, "-n",
                             str(nprocs), sys.executable, str(path), *map(str, args)],
                            cwd=tmp_path, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    return proc.wait(), lines, time.time() - start


def text(lines):
    return "\n".join(line for _, line in lines)


def stamped(lines, pattern):
    """The clock printed on the first line matching ``pattern``."""
    for _, line in lines:
        if re.search(pattern, line) and " at " in line:
            return float(line.rsplit(" at ", 1)[1])
    raise AssertionError(f"no line matches {pattern!r}:\n{text(lines)}")


def errors_of(lines, rank, size):
    return [(t, line) for t, line in lines
            if line.startswith(f"[mpistrat rank {rank}/{size}] UnavailableError:")]


SKIPS = """
import sys
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy()
strategy.reduce("SUM", np.ones(3), axis=None)
if world.rank == world.size - 1:
    stamp("rank", world.rank, "leaves")
    sys.exit(0)                                    # skips the next collective, exits 0
strategy.reduce("SUM", np.ones(3), axis=None)      # the others wait here for it
say("unreachable")
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_rank_that_skips_a_collective_and_exits_0_is_named_by_every_other_rank(tmp_path,
                                                                                nprocs):
    code, lines, seconds = launch(tmp_path, nprocs, SKIPS)
    out = text(lines)
    assert code not in (0, 124), out
    assert "unreachable" not in out
    left = stamped(lines, "leaves")
    last = nprocs - 1
    for rank in range(last):
        found = errors_of(lines, rank, nprocs)
        assert found, f"rank {rank} printed no UnavailableError:\n{out}"
        arrived, line = found[0]
        assert f"rank {last}/{nprocs} (host " in line and "left the job (it exited normally)" \
            in line, line
        assert "this rank waits in all_reduce SUM (Strategy.reduce, called at job.py:" in line
        # bound: the grace, plus rank 0's relay (0.5 s), plus sampling and output (margin 3 s)
        assert arrived - left < GRACE + 3.5, f"{arrived - left:.1f} s after the leave: {line}"


KILLED = """
import os, signal, time
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy()
strategy.reduce("SUM", np.ones(3), axis=None)
if world.rank == world.size - 1:
    time.sleep(0.5)
    stamp("rank", world.rank, "is killed")
    os.kill(os.getpid(), signal.SIGKILL)
strategy.reduce("SUM", np.ones(3), axis=None)
say("unreachable")
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_killed_rank_is_named_by_every_other_rank_even_when_mpirun_would_not_end_the_job(
        tmp_path, nprocs):
    # orte_abort_on_non_zero_status=0: mpirun leaves the others running after a death (as srun
    # does without --kill-on-bad-exit); without the health check this job hangs to its limit.
    code, lines, seconds = launch(tmp_path, nprocs, KILLED, limit=40,
                                  mpirun_args=("--keep-going",))
    out = text(lines)
    assert code not in (0, 124), out
    if os.environ.get("MPISTRAT_MPI") == "mpich":
        # MPICH 4.0's Hydra ends the whole job when a rank is killed, -disable-auto-cleanup
        # or not, often before the health check's message: the job ends, and the output names
        # the death (Hydra's report of the signal, or the health check's error).
        assert seconds < 20, out
        assert "Killed (signal 9)" in out or f"rank {nprocs - 1}/{nprocs} (host " in out, out
        return
    killed = stamped(lines, "is killed")
    for rank in range(nprocs - 1):
        found = errors_of(lines, rank, nprocs)
        assert found, f"rank {rank} printed no UnavailableError:\n{out}"
        arrived, line = found[0]
        assert f"rank {nprocs - 1}/{nprocs} (host " in line and " died: " in line, line
        assert arrived - killed < 3.0, f"{arrived - killed:.1f} s after the kill: {line}"


STOPPED = """
import os, signal, threading, time
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy()
pids = world.comm.allgather(os.getpid())
strategy.reduce("SUM", np.ones(3), axis=None)
if world.rank == 0:                       # wakes rank 1 after 4 x MPISTRAT_HEALTH_TIMEOUT
    threading.Timer(4.0, os.kill, (pids[1], signal.SIGCONT)).start()
if world.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped: alive, only slow
say("rank", world.rank, "sum", strategy.reduce("SUM", np.ones(3), axis=None)[0])
"""


def test_a_stopped_rank_is_alive_and_ends_nothing_without_a_collective_timeout(tmp_path):
    code, lines, seconds = launch(tmp_path, 2, STOPPED, env={"MPISTRAT_HEALTH_TIMEOUT": "1"})
    out = text(lines)
    assert code == 0, out
    assert "UnavailableError" not in out, out
    assert "rank 0 sum 2.0" in out and "rank 1 sum 2.0" in out, out
    assert seconds > 4.0


FINISH_APART = """
import time
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy()
strategy.reduce("SUM", np.ones(3), axis=None)
# the last rank leaves first; the others still work (outside collectives) for 1.5 x the grace
time.sleep(1.5 * (world.size - 1 - world.rank))
say("rank", world.rank, "done")
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_that_finish_at_different_times_raise_no_alarm(tmp_path, nprocs):
    code, lines, seconds = launch(tmp_path, nprocs, FINISH_APART)
    out = text(lines)
    assert code == 0, out
    assert "UnavailableError" not in out, out
    assert out.count("done") == nprocs, out
