"""slurm/train_elastic.sbatch on the namespace Slurm cluster (3 nodes): a job of 4 ranks (node3
drained: 2 nodes x 2) is preempted and requeued; with node2 drained too it restarts on 1 node
(2 ranks), is preempted again, and with every node back and ``ranks_per_node`` set to 1 it
restarts on 3 nodes x 1 rank. Each restart resumes the saved position at its own width, and
with --deterministic the final parameters are bit for bit those of an uninterrupted run."""

import re
import subprocess
import sys

import pytest

from .conftest import ROOT, job_env
from .test_slurm_templates import _read, _wait_for

pytestmark = pytest.mark.timeout(1200)
TEMPLATE = ROOT / "slurm" / "train_elastic.sbatch"
EPOCHS = 12   # (the signals must land mid-training: an epoch here takes a tenth of a second)


def _scontrol(cluster, *args):
    return cluster.script("run", "head", "scontrol", *args, check=False)


def test_preempted_at_4_ranks_resumed_at_2_then_3_with_the_same_bits(cluster, tmp_path):
    out = tmp_path / "elastic.out"
    data, run = tmp_path / "data", tmp_path / "run"
    env = {"RUN_DIR": str(run), "DATA_DIR": str(data), "RANKS_PER_NODE": "2",
           "TRAIN_ARGS": f"--epochs {EPOCHS} --deterministic"}
    _scontrol(cluster, "update", "NodeName=node3", "State=DRAIN", "Reason=elastic-test")
    done = cluster.script("run", "node1", "sbatch", "--parsable", f"--output={out}",
                          "--nodes=1-3", str(TEMPLATE), cwd=ROOT, env=env)
    job_id = done.stdout.strip().split(";")[0]
    text = lambda: _read(out)  # noqa: E731
    try:
        _wait_for(lambda: re.search(rf"epoch +1/{EPOCHS}", text()), 300,
                  "the first epoch at 4 ranks")
        assert "4 ranks on 2 nodes" in text(), text()
        _scontrol(cluster, "update", "NodeName=node2", "State=DRAIN", "Reason=elastic-test")
        cluster.script("run", "head", "scancel", "--signal=USR1", "--batch", job_id)
        _wait_for(lambda: text().count("requeueing job") == 1, 180, "the first requeue")
        # 2 nodes drained: the requeued job (1-3 nodes) restarts on node1 alone, 2 ranks
        _wait_for(lambda: "2 ranks on 1 nodes" in text(), 600, "the restart at 2 ranks")
        _wait_for(lambda: len(re.findall(r"^resumed from", text(), re.M)) == 1 and
                  re.search(rf"epoch +2/{EPOCHS}", text()), 300, "an epoch at 2 ranks")
        (run / "ranks_per_node").write_text("1\n")      # the next restarts: 1 rank per node
        _scontrol(cluster, "update", "NodeName=node[2-3]", "State=RESUME")
        cluster.script("run", "head", "scancel", "--signal=USR1", "--batch", job_id)
        _wait_for(lambda: text().count("requeueing job") == 2, 180, "the second requeue")
        _wait_for(lambda: "finished with exit code" in text(), 900, "the run at 3 ranks")
    finally:
        cluster.script("run", "head", "scancel", job_id, check=False)
        _scontrol(cluster, "update", "NodeName=node[2-3]", "State=RESUME")
    log = text()
    assert "2 ranks on 1 nodes" in log and "3 ranks on 3 nodes" in log, log[-4000:]
    assert "finished with exit code 0" in log, log[-4000:]
    assert len(re.findall(r"^resumed from \S+ckpt-\d+: epoch \d, step \d+ of 23$", log,
                          re.M)) == 2, log[-4000:]
    digest = re.search(r"^parameter digest: ([0-9a-f]{64})$", log, re.M).group(1)
    reference = subprocess.run(
        [str(ROOT / "scripts" / "mpirun"), "--limit", "300", "-n", "2", sys.executable,
         str(ROOT / "jobs" / "train.py"), "--data", str(data), "--checkpoint-dir",
         str(tmp_path / "reference"), "--epochs", str(EPOCHS), "--deterministic"],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert f"parameter digest: {digest}" in reference.stdout, (log[-2000:],
                                                               reference.stdout[-2000:])
