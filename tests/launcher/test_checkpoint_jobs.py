"""Checkpoints across jobs: restore at another world size, and a rank killed mid-save."""

import os

import pytest

SAVE = """
import sys, numpy as np, mpistrat as ms
directory = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
with strategy.scope():
    kernel = ms.Variable(np.arange(600_000, dtype=np.float32).reshape(3000, 200))
    bias = ms.Variable(np.full(7, 2.5))
ckpt = ms.Checkpoint(model={"kernel": kernel, "bias": bias}, epoch=3)
say("saved", ckpt.save(directory + "/ckpt"))
"""

RESTORE = """
import sys, numpy as np, mpistrat as ms
directory = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
with strategy.scope():
    kernel = ms.Variable(np.zeros((3000, 200), dtype=np.float32))
    bias = ms.Variable(np.zeros(7))
holder = {"kernel": kernel, "bias": bias}
ckpt = ms.Checkpoint(model=holder, epoch=0)
ckpt.restore(ms.latest_checkpoint(directory)).assert_consumed()
ok = (np.array_equal(kernel.numpy(), np.arange(600_000, dtype=np.float32).reshape(3000, 200))
      and bias.numpy().tolist() == [2.5] * 7 and ckpt.epoch == 3)
say("restored", strategy.num_replicas_in_sync, ok)
"""


@pytest.mark.parametrize("writers,readers", [(1, 3), (4, 2), (3, 4)])
@pytest.mark.parametrize("mode", ["parallel", "parts"])
def test_restore_at_another_world_size(launch, tmp_path, writers, readers, mode):
    env = {"MPISTRAT_CHECKPOINT_MODE": mode}
    saved = launch(writers, SAVE, str(tmp_path), env=env)
    assert saved.returncode == 0, saved
    restored = launch(readers, RESTORE, str(tmp_path), env=env)
    assert restored.returncode == 0, restored
    assert restored.output.count(f"restored {readers} True") == readers, restored


KILLED = """
import sys, numpy as np, mpistrat as ms
directory = sys.argv[1]
v = ms.Variable(np.full(300_000, 1.0))
ckpt = ms.Checkpoint(v=v)
say("first", ckpt.save(directory + "/ckpt"))
v.assign(np.full(300_000, 2.0))
ckpt.save(directory + "/ckpt")   # rank 1 is killed in here
say("unreachable")
"""

AFTER = """
import os, sys, numpy as np, mpistrat as ms
directory = sys.argv[1]
latest = ms.latest_checkpoint(directory)
v = ms.Variable(np.zeros(300_000))
ckpt = ms.Checkpoint(v=v)
ckpt.restore(latest).assert_consumed()
say("latest", os.path.basename(latest), float(v.numpy()[0]))
ckpt.save(directory + "/ckpt")
leftovers = [n for n in os.listdir(directory) if ".tmp" in n or ".part-" in n and
             not os.path.exists(os.path.join(directory, n.split(".part-")[0] + ".h5"))]
say("leftovers", leftovers)
"""


@pytest.mark.parametrize("mode", ["parallel", "parts"])
def test_rank_killed_mid_save_leaves_previous_checkpoint_intact(launch, tmp_path, mode):
    env = {"MPISTRAT_CHECKPOINT_MODE": mode, "MPISTRAT_TEST_FAULT": "checkpoint-partition-written:1:2"}
    killed = launch(2, KILLED, str(tmp_path), env=env, limit=60)
    assert killed.returncode not in (0, 124), killed
    assert "first" in killed.output and "unreachable" not in killed.output, killed
    torn = [n for n in os.listdir(tmp_path) if ".tmp" in n or ".part-" in n]
    assert torn, "the torn save should have left a temporary or part file behind"
    assert not os.path.exists(tmp_path / "ckpt-2.h5")
    after = launch(2, AFTER, str(tmp_path), env={"MPISTRAT_CHECKPOINT_MODE": mode}, limit=60)
    assert after.returncode == 0, after
    assert after.output.count("latest ckpt-1 1.0") == 2, after
    assert "leftovers []" in after.output, after
