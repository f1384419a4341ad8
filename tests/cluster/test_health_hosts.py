"""The peer health check across real hosts: a host whose link goes down while the others wait
in a collective is named by every rank of the other host within MPISTRAT_HEALTH_TIMEOUT, with
no collective timeout set (without the check, nothing notices for many minutes)."""

import subprocess
import sys
import threading
import time

import pytest

from .conftest import PRELUDE, job_env

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 3.0   # MPISTRAT_HEALTH_TIMEOUT of the job

JOB = """
import time
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
strategy = ms.MultiWorkerMirroredStrategy()
strategy.reduce("SUM", np.ones(3), axis=None)
say("rank", world.rank, "on", world.hostname, "waiting")
if world.hostname == "node2":
    time.sleep(60)      # held back: node1's ranks wait in the collective when the link goes down
strategy.reduce("SUM", np.ones(3), axis=None)
say("rank", world.rank, "finished")
"""


def _link(host: str, state: str) -> None:
    subprocess.run(["ip", "-n", f"mpistrat-{host}", "link", "set", "eth0", state], check=True,
                   timeout=30)


def _wait_for(lines, predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate([line for _, line in lines]):
            return True
        time.sleep(0.05)
    return False


def test_a_host_whose_link_goes_down_mid_collective_is_named_by_the_other_hosts_ranks(
        cluster, tmp_path):
    path = tmp_path / "job.py"
    path.write_text(PRELUDE + JOB)
    command = cluster.command("mpirun", "2x2", [sys.executable, str(path)], limit=150)
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=job_env({"MPISTRAT_HEALTH_TIMEOUT": str(TIMEOUT)}))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line.rstrip("\n"))
                                                          for line in proc.stdout), daemon=True)
    reader.start()

    def reports(seen):
        return [line for line in seen if line.startswith(("[mpistrat rank 0/4] Unavailable",
                                                          "[mpistrat rank 1/4] Unavailable"))]
    try:
        assert _wait_for(lines, lambda seen: sum("waiting" in s for s in seen) == 4, 90), lines
        time.sleep(1.0)                      # node1's ranks are inside the second all-reduce
        down = time.time()
        _link("node2", "down")
        try:
            _wait_for(lines, lambda seen: len(reports(seen)) == 2, TIMEOUT + 20)
        finally:
            _link("node2", "up")             # let mpirun reach node2 again to end the job
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    output = "\n".join(f"{t - down:+.2f} {line}" for t, line in lines)
    print(output)
    assert proc.returncode not in (0, 124), output
    assert "finished" not in output, output
    for rank in (0, 1):
        found = [(t, line) for t, line in lines
                 if line.startswith(f"[mpistrat rank {rank}/4] UnavailableError:")]
        assert found, f"rank {rank} on node1 printed no UnavailableError:\n{output}"
        arrived, line = found[0]
        assert "(host node2, pid " in line and " is unreachable: its host has not answered" \
            in line, line
        assert "this rank waits in all_reduce SUM (Strategy.reduce, called at job.py:" in line
        # bound: keepalives start after 1 s idle, the kernel gives up TIMEOUT s after the last
        # answer; margin for rank 0's report to rank 1 and for the output path
        assert arrived - down < TIMEOUT + 5.0, f"{arrived - down:.1f} s after the link went down"
