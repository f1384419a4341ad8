"""PreemptionCheckpointHandler under mpirun: a signal to one rank makes every rank save at the
same step and exit with 75; the restarted job continues at exactly that step."""

import os
import re
import signal
import subprocess
import sys
import time

import h5py
import pytest

from conftest import MPIRUN, PRELUDE

JOB = """
import os, sys, time, numpy as np, mpistrat as ms
directory, total = sys.argv[1], int(sys.argv[2])
strategy = ms.MultiWorkerMirroredStrategy()
rank, n = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
with strategy.scope():
    w = ms.Variable(np.zeros(3), aggregation=ms.VariableAggregation.SUM)
manager = ms.CheckpointManager(ms.Checkpoint(w=w), directory, max_to_keep=2)
handler = ms.distribute.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
say("pid", rank, os.getpid(), "start", handler.total_run_calls, w.numpy()[0])

def step(k):
    w.assign_add(np.full(3, float(k)))   # SUM over the replicas: w grows by n * k
    time.sleep(0.02)

while handler.total_run_calls < total:
    k = handler.total_run_calls
    handler.run(strategy.run, step, args=(k,))
    if rank == 0:
        say("step", k)
say("done", rank, handler.total_run_calls, w.numpy()[0])
"""


def _start(tmp_path, ranks, *args):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([str(MPIRUN), "--limit", "120", "-n", str(ranks), sys.executable,
                             str(script), *args], env=env, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _read_until(job, pattern, lines, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = job.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r}:\n{''.join(lines)[-3000:]}")


@pytest.mark.parametrize("ranks,target,signum", [(2, 1, signal.SIGUSR1),
                                                 (3, 0, signal.SIGTERM)])
def test_signal_to_one_rank_saves_everywhere_at_one_step_and_restart_continues(
        tmp_path, ranks, target, signum):
    directory, total = str(tmp_path / "ckpt"), 400
    job = _start(tmp_path, ranks, directory, str(total))
    lines = []
    try:
        pids = {}
        while len(pids) < ranks:
            match = _read_until(job, r"^pid (\d+) (\d+) start 0 0.0", lines)
            pids[int(match.group(1))] = int(match.group(2))
        _read_until(job, r"^step 20$", lines)
        os.kill(pids[target], signum)
        rest, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    output = "".join(lines) + rest
    assert job.returncode == 75, output[-3000:]
    name = signal.Signals(signum).name
    saved = re.search(rf"\[mpistrat\] {name} on rank {target}: every rank saved at step "
                      rf"(\d+): (\S+); exiting with 75", output)
    assert saved, output[-3000:]
    step = int(saved.group(1))
    last_step = max(int(k) for k in re.findall(r"^step (\d+)$", output, re.M))
    assert 20 < step == last_step + 1 < total, output[-3000:]
    assert "done" not in output
    with h5py.File(saved.group(2) + ".h5", "r") as f:
        assert int(f["preemption/total_run_calls"][()]) == step
        assert f["w"][0] == ranks * sum(range(step))     # exactly `step` steps were applied

    again = _start(tmp_path, ranks, directory, str(total))
    output, _ = again.communicate(timeout=110)
    assert again.returncode == 0, output[-3000:]
    assert output.count(f"start {step} {float(ranks * sum(range(step)))}") == ranks, output
    assert output.count(f"{total} {float(ranks * sum(range(total)))}") == ranks, output


WATCHED = """
import os, sys, time, numpy as np, mpistrat as ms
directory, flag, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
strategy = ms.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id
step_var = ms.Variable(np.int64(0))
ckpt = ms.Checkpoint(step=step_var)

def leave():
    say("exit_fn", rank, int(step_var.numpy()))
    raise SystemExit(3)

config = ms.distribute.experimental.TerminationConfig(
    termination_watcher_fn=lambda: rank == 1 and os.path.exists(flag), exit_fn=leave,
    grace_period=60)
handler = ms.distribute.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, ckpt, checkpoint_dir=directory, termination_config=config)
say("start", rank, handler.total_run_calls, int(step_var.numpy()))
with handler.watch_preemption_scope():
    while int(step_var.numpy()) < limit:
        step_var.assign_add(1)
        time.sleep(0.002)
        if int(step_var.numpy()) == 5 and rank == 0:
            open(flag, "w").close()      # rank 1's watcher reports a preemption
        handler.save_checkpoint_if_preempted()
"""


def test_watcher_fn_checkpoint_dir_and_exit_fn(launch, tmp_path):
    directory, flag = str(tmp_path / "ckpt"), str(tmp_path / "preempt-now")
    first = launch(2, WATCHED, directory, flag, "20000", limit=90)
    assert first.returncode == 3, first
    steps = {int(s) for s in re.findall(r"^exit_fn \d (\d+)$", first.output, re.M)}
    assert len(steps) == 1 and first.output.count("exit_fn") == 2, first
    (step,) = steps
    assert step >= 5
    os.remove(flag)
    second = launch(2, WATCHED + "\nsay('finished', rank, int(step_var.numpy()))\n", directory,
                    flag, str(step), limit=90)
    assert second.returncode == 0, second
    for rank in (0, 1):
        assert f"start {rank} 0 {step}" in second.output, second
        assert f"finished {rank} {step}" in second.output, second


def test_checkpoint_without_directory_is_refused():
    import mpistrat as ms
    with pytest.raises(ValueError, match="checkpoint_dir"):
        ms.distribute.experimental.PreemptionCheckpointHandler(None, ms.Checkpoint())
    with pytest.raises(ValueError, match="Checkpoint or ms.CheckpointManager"):
        ms.distribute.experimental.PreemptionCheckpointHandler(None, object())
