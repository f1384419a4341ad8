"""The Slurm templates: valid bash with the directives they promise, and the preemptible
template's own logic (forward USR1, requeue on exit 75, resume) run outside Slurm with
``LAUNCH=mpirun`` and a stand-in ``scontrol`` that records its arguments. Real ``sbatch`` runs
of these templates belong to the multi-host cluster tests."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

TEMPLATES = sorted((ROOT / "slurm").glob("train_*.sbatch"))


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_is_valid_bash_and_runs_the_main_job(template):
    subprocess.run(["bash", "-n", str(template)], check=True)
    text = template.read_text()
    assert "jobs/train.py" in text and "--checkpoint-dir \"$RUN_DIR\"" in text
    assert re.search(r"^#SBATCH --nodes=\d+", text, re.M)
    launcher = "$LAUNCH" if "preemptible" in template.name else 'srun --mpi="$SRUN_MPI"'
    assert launcher in text
    assert 'source "${MPISTRAT_SITE:-slurm/site.sh}"' in text     # the site's modules, venv, --mpi


def test_templates_ask_for_what_their_strategy_needs():
    text = {p.name: p.read_text() for p in TEMPLATES}
    assert "--strategy mirrored" in text["train_one_node.sbatch"]
    assert "#SBATCH --nodes=1" in text["train_one_node.sbatch"]
    assert "#SBATCH --gpus-per-task=1" in text["train_multi_node.sbatch"]
    assert "--strategy multiworker" in text["train_multi_node.sbatch"]
    assert "#SBATCH --ntasks-per-node=1" in text["train_tpu_hosts.sbatch"]
    assert "--replicas tpu" in text["train_tpu_hosts.sbatch"]
    pre = text["train_preemptible.sbatch"]
    assert "#SBATCH --signal=B:USR1@120" in pre and "#SBATCH --requeue" in pre
    assert "PREEMPTED=75" in pre and "scontrol requeue" in pre
    from mpistrat.preemption import PREEMPTED_EXIT_CODE
    assert PREEMPTED_EXIT_CODE == 75


def _env(tmp_path, **extra):
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.calls\n")
    (fake / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(PATH=f"{fake}:{env['PATH']}", PYTHONUNBUFFERED="1", PYTHON=sys.executable,
               RUN_DIR=str(tmp_path / "run"), DATA_DIR=str(tmp_path / "data"),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="t", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               LAUNCH="mpirun --oversubscribe -n 2")   # mpirun forwards USR1; timeout would not
    env.update(extra)
    return env


def _finish(job, seconds):
    """Wait for the script under a limit; kill its whole process group on expiry."""
    try:
        return job.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        raise


def test_preemptible_template_requeues_on_usr1_and_the_requeued_run_resumes(tmp_path):
    script = str(ROOT / "slurm" / "train_preemptible.sbatch")
    env = _env(tmp_path, TRAIN_ARGS="--epochs 500")
    job = subprocess.Popen(["bash", script], cwd=ROOT, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    deadline = time.monotonic() + 150
    state = tmp_path / "run" / "checkpoint"
    while time.monotonic() < deadline and job.poll() is None and not (
            state.exists() and "ckpt-2\"" in state.read_text()):
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGUSR1)       # what Slurm does 120 s before the time limit
    output = _finish(job, 120).replace("\r", "\n")
    assert job.returncode == 0, output[-3000:]
    assert "USR1: asking every rank to checkpoint" in output, output[-3000:]
    saved = re.search(r"\[mpistrat\] SIGUSR1 on rank \d: every rank saved at step (\d+)", output)
    assert saved, output[-3000:]
    assert "requeueing job 4242" in output
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"

    env = _env(tmp_path, TRAIN_ARGS="--epochs 500", SLURM_RESTART_COUNT="1", MAX_REQUEUES="1")
    again = subprocess.Popen(["bash", script], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and again.poll() is None:
        line = again.stdout.readline()
        output2 = line
        if line.startswith("resumed from"):
            break
    steps = int(saved.group(1))
    assert re.match(rf"resumed from .*: epoch {steps // 23 + 1}, step {steps % 23} of 23",
                    output2), output2
    os.kill(again.pid, signal.SIGUSR1)     # preempted again, but the requeue limit is reached
    output2 = _finish(again, 120).replace("\r", "\n")
    assert again.returncode == 75, output2[-3000:]
    assert "not requeued (1 restarts reached)" in output2
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"
