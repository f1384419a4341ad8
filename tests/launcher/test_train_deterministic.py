"""``jobs/train.py --deterministic``: the same parameter bits at 1, 2, 3 and 4 ranks, and after a
preemption at 4 ranks resumed at 2 (every example's gradient alone, one exact sum; the data
position carried to the new width)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MPIRUN, ROOT, descendants

JOB = str(ROOT / "jobs" / "train.py")
FLAGS = ["--epochs", "1", "--global-batch", "64", "--deterministic", "--checkpoint-every", "5"]
DIGEST = re.compile(r"^parameter digest: ([0-9a-f]{64})$", re.M)


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
    return env


def _command(ranks, data, ckpt):
    return [str(MPIRUN), "--limit", "240", "-n", str(ranks), sys.executable, JOB, "--data",
            str(data), "--checkpoint-dir", str(ckpt), *FLAGS]


def _digest(ranks, data, ckpt):
    done = subprocess.run(_command(ranks, data, ckpt), env=_env(), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    return DIGEST.search(done.stdout).group(1), done.stdout


def _ranks_of(pid):
    found = descendants(pid)
    jobs = set()
    for _, p in found:   # the ranks themselves (python jobs/train.py ...), not the launchers
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1].decode(errors="replace") == JOB:
            jobs.add(p)
    # not a rank's own child caught between fork and exec (the checkpoint's layout child
    # has its parent's command line until it execs)
    return [p for parent, p in found if p in jobs and parent not in jobs]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("digits")


def test_one_digest_at_every_width_and_across_a_4_to_2_resume(data, tmp_path):
    digests = {ranks: _digest(ranks, data, tmp_path / f"run{ranks}")[0] for ranks in (1, 2, 3, 4)}
    assert len(set(digests.values())) == 1, digests

    ckpt = tmp_path / "preempted"
    log = open(tmp_path / "preempted.log", "w+")
    job = subprocess.Popen(_command(4, data, ckpt), env=_env(), cwd=ROOT, text=True,
                           stdout=log, stderr=subprocess.STDOUT)
    ranks = []
    try:
        deadline = time.monotonic() + 240
        state = ckpt / "checkpoint"            # ckpt-1: saved after step 5 of the epoch
        while time.monotonic() < deadline and job.poll() is None and not (
                state.exists() and "ckpt-1\"" in state.read_text().split("\n")[0]):
            time.sleep(0.05)
        ranks = _ranks_of(job.pid)
        assert len(ranks) == 4, "no 4 rank processes under mpirun"
        os.kill(ranks[1], signal.SIGTERM)    # as Slurm does before preempting a job
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            job.kill()
            job.wait()
    log.seek(0)
    output = log.read()
    log.close()
    assert job.returncode == 75 and "parameter digest" not in output, output[-3000:]
    resumed, text = _digest(2, data, ckpt)
    assert re.search(r"^resumed from .*ckpt-\d+: epoch 1, step \d+ of 23$", text, re.M), text
    assert resumed == digests[1], text[-3000:]
