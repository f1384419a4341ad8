"""Checkpoints across real hosts: written on 2 hosts x 2 ranks, restored on 3 x 1 and on 1
rank; a directory that only one host can see ends in a named error on every rank."""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

JOB_WRITE = """
import json, sys
import numpy as np
import mpistrat as ms
directory = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
with strategy.scope():
    kernel = ms.Variable(np.arange(3001 * 7, dtype=np.float32).reshape(3001, 7), name="kernel")
    bias = ms.Variable(np.full(7, 0.5), name="bias")
    seen = ms.Variable(0.0, synchronization=ms.VariableSynchronization.ON_READ,
                       aggregation=ms.VariableAggregation.SUM)
    step = ms.Variable(0, dtype=np.int64)
strategy.run(lambda: seen.assign_add(1.0))
kernel.assign_add(np.ones((3001, 7), dtype=np.float32))
step.assign(41)
manager = ms.CheckpointManager(ms.Checkpoint(model={"kernel": kernel, "bias": bias}, seen=seen,
                                             step=step), directory, max_to_keep=2)
path = manager.save()
from mpistrat.runtime import get_world
say(json.dumps({"rank": get_world().rank, "path": path, "seen": float(seen.numpy())}))
"""

JOB_RESTORE = """
import json, sys
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
directory = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
with strategy.scope():
    kernel = ms.Variable(np.zeros((3001, 7), dtype=np.float32), name="kernel")
    bias = ms.Variable(np.zeros(7), name="bias")
    seen = ms.Variable(0.0, synchronization=ms.VariableSynchronization.ON_READ,
                       aggregation=ms.VariableAggregation.SUM)
    step = ms.Variable(0, dtype=np.int64)
ckpt = ms.Checkpoint(model={"kernel": kernel, "bias": bias}, seen=seen, step=step)
latest = ms.latest_checkpoint(directory)
ckpt.restore(latest).assert_consumed()
with strategy.scope():
    total_seen = float(seen)   # ON_READ SUM: read in cross-replica context, the sum
want = np.arange(3001 * 7, dtype=np.float32).reshape(3001, 7) + 1
say(json.dumps({"rank": get_world().rank, "host": get_world().hostname, "latest": latest,
                "kernel_ok": bool(np.array_equal(kernel.numpy(), want)),
                "bias": bias.numpy().tolist(), "seen": total_seen,
                "step": int(step.numpy()), "replicas": strategy.num_replicas_in_sync}))
"""


def test_written_on_2x2_restores_on_3x1_and_on_1_rank(job, tmp_path):
    shared = tmp_path / "shared"   # under /tmp: every host sees the same directory
    written = job("mpirun", "2x2", JOB_WRITE, shared)
    assert written.returncode == 0, written
    paths = {row["path"] for row in written.rows()}
    assert paths == {str(shared / "ckpt-1")}, written
    for launcher, layout, size in [("srun", "3x1", 3), ("mpirun", "1x1", 1)]:
        restored = job(launcher, layout, JOB_RESTORE, shared)
        assert restored.returncode == 0, restored
        rows = restored.rows()
        assert len(rows) == size, restored
        for row in rows:
            assert row["latest"] == str(shared / "ckpt-1"), row
            assert row["kernel_ok"], row
            assert row["bias"] == [0.5] * 7, row
            assert row["step"] == 41, row
            assert row["replicas"] == size, row
            # ON_READ SUM: the 4 writers' sum is restored, whatever the new replica count.
            assert row["seen"] == 4.0, row
        assert sorted(row["host"] for row in rows) == [f"node{i + 1}" for i in range(size)]


@pytest.fixture
def private_dir(cluster, tmp_path):
    """A directory with a tmpfs mounted on node1 only: other hosts see an empty directory."""
    path = tmp_path / "private"
    path.mkdir()
    cluster.script("run", "node1", "mount", "-t", "tmpfs", "-o", "size=64m", "ckpt-private", path)
    yield path
    cluster.script("run", "node1", "umount", path, check=False)


JOB_SAVE_ONLY = """
import sys
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
strategy = ms.MultiWorkerMirroredStrategy()
with strategy.scope():
    kernel = ms.Variable(np.ones((1000, 9)), name="kernel")
try:
    ms.Checkpoint(kernel=kernel).save(sys.argv[1] + "/ckpt")
    say("rank", get_world().rank, "saved")
except Exception as err:
    say("rank", get_world().rank, "raised", type(err).__name__ + ":", err)
    raise
"""


# Known failures of today's checkpoint layer (its agreement rules are being reworked in
# mpistrat/checkpoint/); the tests hold the behaviour we want and run under short limits.
def test_save_into_a_directory_only_one_host_sees_fails_on_every_rank(job, private_dir):
    # Rank 0 (node1) creates the directory inside node1's tmpfs; node2 never sees it.
    result = job("mpirun", "2x2", JOB_SAVE_ONLY, private_dir / "run", limit=30,
                 env={"MPISTRAT_COLLECTIVE_TIMEOUT": "15"})
    assert result.returncode != 124, f"the job hung until the time limit: {result}"
    assert result.returncode != 0, result
    assert "saved" not in result.output, result
    for rank in range(4):
        assert f"rank {rank} raised" in result.output, result
    assert str(private_dir / "run") in result.output, result


def test_restore_from_a_directory_only_one_host_sees_fails_on_every_rank(cluster, job, tmp_path,
                                                                        private_dir):
    shared = tmp_path / "shared"
    written = job("mpirun", "1x1", JOB_WRITE, shared)
    assert written.returncode == 0, written
    cluster.script("run", "node1", "cp", "-a", shared, private_dir / "copy")
    result = job("mpirun", "2x2", JOB_RESTORE_NAMED, private_dir / "copy", limit=30,
                 env={"MPISTRAT_COLLECTIVE_TIMEOUT": "15"})
    assert result.returncode != 124, f"the job hung until the time limit: {result}"
    assert result.returncode != 0, result
    rows = {row["rank"]: row for row in result.rows()}
    assert sorted(rows) == [0, 1, 2, 3], result
    assert not any(row["restored"] for row in rows.values()), result
    for row in rows.values():   # a named error: mpistrat's or the OS's, naming the path
        assert row["named"], row
        assert str(private_dir / "copy") in row["message"], row


JOB_RESTORE_NAMED = """
import json, sys
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
rank = get_world().rank
strategy = ms.MultiWorkerMirroredStrategy()
with strategy.scope():
    kernel = ms.Variable(np.zeros((3001, 7), dtype=np.float32), name="kernel")
    bias = ms.Variable(np.zeros(7), name="bias")
    seen = ms.Variable(0.0, synchronization=ms.VariableSynchronization.ON_READ,
                       aggregation=ms.VariableAggregation.SUM)
    step = ms.Variable(0, dtype=np.int64)
ckpt = ms.Checkpoint(model={"kernel": kernel, "bias": bias}, seen=seen, step=step)
path = sys.argv[1] + "/ckpt-1"
try:
    ckpt.restore(path)
    say(json.dumps({"rank": rank, "restored": True}))
except Exception as err:
    say(json.dumps({"rank": rank, "restored": False, "error": type(err).__name__,
                    "named": isinstance(err, (OSError, ms.errors.OpError)),
                    "message": str(err)}))
    raise
"""
