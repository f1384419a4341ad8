"""Failures across hosts: a rank killed on one host ends the job; a stalled host (its ranks
stopped with SIGSTOP) makes the others raise DeadlineExceededError naming the operation."""

import re
import time

import pytest

from .conftest import LAUNCHERS, parse_layout

pytestmark = pytest.mark.timeout(180)

JOB_KILLED = """
import os, signal, time
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy()
strategy.reduce("SUM", np.ones(3), axis=None)
say("rank", world.rank, "on", world.hostname, "ready")
if world.rank == world.size - 1:          # on the last host
    say("killing at", repr(time.time()))  # (the hosts share this machine's clock)
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(10 ** 6):
    strategy.reduce("SUM", np.ones(3), axis=None)   # the others wait here for the dead rank
say("unreachable")
"""


@pytest.mark.parametrize("launcher,layout", [("mpirun", "2x2"), ("srun", "3x1")])
def test_a_rank_killed_on_one_host_ends_the_job(job, launcher, layout):
    result = job(launcher, layout, JOB_KILLED, limit=60)
    ended = time.time()
    hosts, per_host = parse_layout(layout)
    assert result.returncode not in (0, 124), result
    # Timed from the kill: a step's start on a loaded machine may take long itself.
    killed = float(re.search(r"killing at ([0-9.]+)", result.output).group(1))
    assert ended - killed < 30, f"the job took {ended - killed:.0f}s to end after the kill " \
                                f"({result.seconds:.0f}s in all): {result}"
    assert result.output.count("ready") == hosts * per_host, result
    assert f"on node{hosts} ready" in result.output, result
    assert "unreachable" not in result.output, result


JOB_STALLED_HOST = """
import os, signal
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy(
    communication_options=ms.CommunicationOptions(timeout_seconds=3.0))
strategy.reduce("SUM", np.ones(3), axis=None)
hosts = world.comm.allgather(world.hostname)
if world.hostname == hosts[-1]:
    say("rank", world.rank, "stopping on", world.hostname)
    os.kill(os.getpid(), signal.SIGSTOP)       # the whole last host stalls
try:
    strategy.reduce("SUM", np.ones(1000), axis=None)
    say("rank", world.rank, "finished")
except ms.errors.DeadlineExceededError as err:
    say("rank", world.rank, "caught DeadlineExceededError:", err)
    raise
"""


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stalled_host_makes_the_others_raise_deadline_exceeded(job, launcher):
    layout = "2x2"
    result = job(launcher, layout, JOB_STALLED_HOST, limit=60)
    assert result.returncode not in (0, 124), result
    assert result.seconds < 45, result
    assert "finished" not in result.output, result
    for rank in (2, 3):
        assert f"rank {rank} stopping on node2" in result.output, result
    # The ranks of node1 each raise the named error (rank 0's report may be cut short by the
    # abort that the first one starts, so at least one of them must be seen in full).
    caught = [line for line in result.output.splitlines()
              if line.startswith("rank ") and "caught DeadlineExceededError" in line]
    assert caught, result
    for line in caught:
        assert line.startswith(("rank 0 ", "rank 1 ")), line
        assert "all_reduce SUM" in line, line    # the operation, named
        assert "did not complete within timeout_seconds=3" in line, line
