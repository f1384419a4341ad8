"""The slurm/ templates, submitted with sbatch to the namespace cluster (2 nodes)."""

import re

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def test_demo_template_runs_on_two_nodes(cluster, tmp_path):
    # 2 tasks per node: each namespace node offers the machine's 2 CPUs.
    info, output = cluster.sbatch(ROOT / "slurm" / "demo.sbatch", "--ntasks-per-node=2",
                                  cwd=ROOT, out_dir=tmp_path)
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
