"""Checkpoints under the job's own signals and stalls (issue 17): SIGTERM to every process of
rank 0 in the middle of a save (as Slurm signals a whole step) leaves the HDF5 layout child
alive, so the save completes and the preemption handler exits 75; a rank stopped (SIGSTOP)
at a named point of a save, an async save or a restore makes the others raise a named
error within the collective timeout instead of hanging."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import MPIRUN, PRELUDE, descendants

SAVING = """
import os, sys, time, numpy as np, mpistrat as ms
directory = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id
with strategy.scope():
    w = ms.Variable(np.zeros(1000))
manager = ms.CheckpointManager(ms.Checkpoint(w=w), directory, max_to_keep=2)
handler = ms.distribute.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
say("pid", rank, os.getpid())
while handler.total_run_calls < 400:
    handler.run(strategy.run, lambda: w.assign_add(np.ones(1000)))
    manager.save()               # a save in flight most of the time: its layout child too
say("done", rank)
"""


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
    return env


def _children(pid):
    return [child for parent, child in descendants(pid) if parent == pid]


def _layout_child(pid):
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmd:
                if b"h5layout.py" in cmd.read():
                    return child
        except OSError:
            pass
    return None


def test_sigterm_to_every_process_of_rank_0_during_a_save_exits_75(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + SAVING)
    job = subprocess.Popen([str(MPIRUN), "--limit", "120", "-n", "2", sys.executable, str(script),
                            str(tmp_path / "ckpt")], env=_env(), cwd=tmp_path, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        while True:
            line = job.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if line.startswith("pid 0 "):
                rank0 = int(line.split()[2])
                break
        deadline, child = time.monotonic() + 60, None
        while child is None and time.monotonic() < deadline:
            child = _layout_child(rank0)
        assert child is not None, "no HDF5 layout child seen in 60 s"
        for pid in [rank0] + _children(rank0):   # every process of rank 0, the child included
            os.kill(pid, signal.SIGTERM)
        rest, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    output = "".join(lines) + rest
    assert "HDF5 crashed" not in output and "Traceback" not in output, output[-3000:]
    assert job.returncode == 75, output[-3000:]
    assert re.search(r"\[mpistrat\] SIGTERM on rank 0: every rank saved at step \d+", output), \
        output[-3000:]


STALLED = """
import os, sys, time, numpy as np, mpistrat as ms
directory, scenario, timeout = sys.argv[1], sys.argv[2], sys.argv[3]
options = ms.CommunicationOptions(timeout_seconds=float(timeout)) if timeout != "env" else None
strategy = ms.MultiWorkerMirroredStrategy(communication_options=options)
rank = strategy.cluster_resolver.task_id
with strategy.scope():
    w = ms.Variable(np.arange(1000.0))
ckpt = ms.Checkpoint(w=w)
if scenario == "restore":
    path = ckpt.save(directory + "/ckpt")
start = time.monotonic()
try:
    if scenario == "save":
        ckpt.save(directory + "/ckpt")
    elif scenario == "async":
        ckpt.save(directory + "/ckpt", options=ms.CheckpointOptions(enable_async=True))
        ckpt.sync()
    else:
        ckpt.restore(path)
    say("finished", rank)
except Exception as err:
    say("error", rank, type(err).__name__, round(time.monotonic() - start, 1))
    os._exit(3)
"""

TIMEOUT = 5


@pytest.mark.parametrize("scenario,point,given", [
    ("save", "checkpoint-before-checksums", "env"),
    ("async", "checkpoint-before-checksums", "env"),
    ("restore", "checkpoint-before-reading", "env"),
    # the strategy's CommunicationOptions(timeout_seconds) covers its checkpoints too
    ("save", "checkpoint-before-checksums", "options"),
    ("restore", "checkpoint-before-reading", "options")])
def test_a_rank_stopped_in_a_checkpoint_makes_the_others_raise_within_the_timeout(
        tmp_path, scenario, point, given):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + STALLED)
    env = dict(_env(), MPISTRAT_TEST_FAULT=f"{point}:1:1:STOP")
    if given == "env":
        env["MPISTRAT_COLLECTIVE_TIMEOUT"] = str(TIMEOUT)
    job = subprocess.Popen([str(MPIRUN), "--limit", "60", "-n", "2", sys.executable, str(script),
                            str(tmp_path / "ckpt"), scenario,
                            "env" if given == "env" else str(TIMEOUT)], env=env, cwd=tmp_path, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    found = re.search(r"^error 0 (\w+) ([\d.]+)$", output, re.M)
    assert found, output[-3000:]
    assert found.group(1) == "DeadlineExceededError", output[-3000:]
    assert float(found.group(2)) < TIMEOUT + 5, output[-3000:]
    assert job.returncode not in (0, 124), output[-3000:]  # ended, not killed by the limit


WIDTHS = """
import sys, numpy as np, ml_dtypes, mpistrat as ms
directory, action = sys.argv[1], sys.argv[2]
strategy = ms.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id
with strategy.scope():
    counter = ms.Variable(np.int64(0), synchronization=ms.VariableSynchronization.ON_READ,
                          aggregation=ms.VariableAggregation.SUM)
    bf16 = ms.Variable(np.zeros(5, ml_dtypes.bfloat16))
tree = {"f8": np.zeros(300_000, ml_dtypes.float8_e4m3fn), "big": np.zeros(7, ">f8"),
        "when": np.zeros(2, "M8[us]")}
want = {"f8": (np.arange(300_000) % 200 - 100).astype(ml_dtypes.float8_e4m3fn),
        "big": (np.arange(7) / 7).astype(">f8"), "when": np.array(["2026-12-01", "NaT"], "M8[us]")}
ckpt = ms.Checkpoint(counter=counter, bf16=bf16, tree=tree)
if action == "save":
    strategy.run(lambda: counter.assign(np.int64(5 if rank == 0 else 0)))
    bf16.assign(np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16))
    for k, v in want.items():
        tree[k][...] = v
    with strategy.scope():
        say("before", rank, int(counter.numpy()))
        ckpt.save(directory + "/ckpt")
else:
    with strategy.scope():
        ckpt.restore(ms.latest_checkpoint(directory)).assert_consumed()
        same = all(tree[k].dtype == v.dtype and tree[k].tobytes() == v.tobytes()
                   for k, v in want.items())
        same &= bf16.numpy().tobytes() == np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16).tobytes()
        say("after", rank, int(counter.numpy()), same)
"""


def test_counter_and_dtypes_saved_at_2_ranks_restore_at_1_2_3(launch, tmp_path):
    saved = launch(2, WIDTHS, str(tmp_path), "save")
    assert saved.returncode == 0 and saved.output.count("before") == 2, saved
    assert "before 0 5" in saved.output, saved
    for ranks in (1, 2, 3):
        restored = launch(ranks, WIDTHS, str(tmp_path), "restore")
        assert restored.returncode == 0, restored
        for rank in range(ranks):
            assert f"after {rank} 5 True" in restored.output, restored
