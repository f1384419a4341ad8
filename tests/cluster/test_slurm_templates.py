"""The slurm/ templates, submitted with sbatch to the namespace cluster (2 nodes)."""

import re
import time

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def test_demo_template_runs_on_two_nodes_as_written(cluster, tmp_path):
    # As written (2 tasks per node): each namespace node offers the machine's 2 CPUs, and a
    # template that asked for more stayed PENDING for ever there (issue 42).
    info, output = cluster.sbatch(ROOT / "slurm" / "demo.sbatch", cwd=ROOT, out_dir=tmp_path)
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + output
    assert re.search(r"NodeList=node\[1-2\]", info), info
    lines = sorted(line for line in output.splitlines() if line.startswith("[rank"))
    assert len(lines) == 4, output
    for rank, line in enumerate(lines):
        assert line == (f"[rank {rank}] replicas=4 sum of replica ids=6 gathered=[0, 1, 2, 3] "
                        f"weights=[-1.5, -1.5, -1.5, -1.5]"), output


def test_tpu_template_trains_and_resumes_on_two_jax_hosts(cluster, tmp_path):
    env = {"RUN_DIR": str(tmp_path / "run")}
    for attempt, resumed in [(1, False), (2, True)]:
        info, output = cluster.sbatch(ROOT / "slurm" / "tpu_train.sbatch", cwd=ROOT,
                                      out_dir=tmp_path, env=env)
        assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + output
        epochs = [line for line in output.splitlines() if line.startswith("epoch ")]
        assert len(epochs) == 2, output
        for line in epochs:
            assert "hosts 2 x 4 cpu devices" in line, line
            assert f"resumed={resumed}" in line, line
        assert f"ckpt-{2 * attempt}" in epochs[-1], epochs
        assert any(line.startswith("final w ") for line in output.splitlines()), output


def _submit(cluster, script, out, env, *options):
    done = cluster.script("run", "node1", "sbatch", "--parsable", f"--output={out}", *options,
                          str(script), cwd=ROOT, env=env)
    return done.stdout.strip().split(";")[0]


def _read(path) -> str:
    """A job's output file so far ("" before it exists): a read can end inside a character
    of a progress bar still being written."""
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not within {seconds}s")


def test_cpu_training_template_trains_on_two_nodes(cluster, tmp_path):
    env = {"RUN_DIR": str(tmp_path / "run"), "DATA_DIR": str(tmp_path / "data"),
           "TRAIN_ARGS": "--epochs 3"}
    info, output = cluster.sbatch(ROOT / "slurm" / "train_cpu.sbatch", cwd=ROOT,
                                  out_dir=tmp_path, env=env, timeout=240)
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + output
    assert re.search(r"NodeList=node\[1-2\]", info), info
    assert "4 replicas (MultiWorkerMirroredStrategy" in output, output
    accuracy = float(re.search(r"^test accuracy: (0\.\d+)$", output, re.M).group(1))
    assert accuracy > 0.8, output
    assert (tmp_path / "run" / "ckpt-3.h5").exists() and (tmp_path / "run" / "checkpoint").exists()


def test_preemptible_template_requeues_and_resumes(cluster, tmp_path):
    out = tmp_path / "preemptible.out"
    env = {"RUN_DIR": str(tmp_path / "run"), "DATA_DIR": str(tmp_path / "data"),
           "TRAIN_ARGS": "--epochs 12"}
    job_id = _submit(cluster, ROOT / "slurm" / "train_preemptible.sbatch", out, env)
    try:
        _wait_for(lambda: "epoch   2/12" in _read(out), 180,
                  "the first epochs")
        # the warning signal of --signal=B:USR1@120, sent now: to the batch script
        cluster.script("run", "head", "scancel", "--signal=USR1", "--batch", job_id)
        _wait_for(lambda: "requeueing job" in _read(out), 120, "the requeue")
        # Slurm holds a requeued job back for cred_expire (20 s in scripts/cluster) first
        # the template's last line (squeue can answer nothing for a moment around a requeue)
        _wait_for(lambda: "finished with exit code" in _read(out), 600, "the resumed run")
    finally:
        cluster.script("run", "head", "scancel", job_id, check=False)
    text = _read(out)
    assert "restart 1" in text, text                       # SLURM_RESTART_COUNT after requeue
    assert "finished with exit code 0" in text, text
    assert re.search(r"^resumed from \S+ckpt-\d+: epoch \d+, step", text, re.M), text
    assert re.search(r"^test accuracy: 0\.\d+$", text, re.M), text


MPICH_PYTHON = ROOT / ".venv-mpich" / "bin" / "python"


@pytest.mark.skipif(not MPICH_PYTHON.exists(), reason=(
    ".venv-mpich is missing: scripts/setup.sh --mpi mpich builds it (make test's MPICH stage)"))
def test_site_block_runs_mpich_under_pmi2_and_a_wrong_plugin_is_refused(cluster, tmp_path):
    """The site's MPI is MPICH: SRUN_MPI=pmi2 with its environment (VENV) runs the demo on 2
    nodes; srun --mpi=pmix starts 4 singletons, which every task refuses, naming the fix
    (before the refusal each task trained alone: 'replicas=1', exit 0)."""
    env = {"VENV": str(ROOT / ".venv-mpich"), "SRUN_MPI": "pmi2"}
    info, output = cluster.sbatch(ROOT / "slurm" / "demo.sbatch", "--ntasks-per-node=2",
                                  cwd=ROOT, out_dir=tmp_path, env=env)
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + output
    assert sorted(line for line in output.splitlines() if line.startswith("[rank"))[-1] == (
        "[rank 3] replicas=4 sum of replica ids=6 gathered=[0, 1, 2, 3] "
        "weights=[-1.5, -1.5, -1.5, -1.5]"), output
    info, output = cluster.sbatch(ROOT / "slurm" / "demo.sbatch", "--ntasks-per-node=2",
                                  cwd=ROOT, out_dir=tmp_path, env=dict(env, SRUN_MPI="pmix"))
    assert "JobState=FAILED" in info, info + output
    # every task refuses; srun may end the others when the first exits, before they print
    assert output.count("UnavailableError: srun started 4 tasks (SLURM_STEP_NUM_TASKS, "
                        "--mpi=pmix) but MPI sees a world of 1 rank") >= 1, output
    assert "replicas=" not in output, output              # no task trained alone
