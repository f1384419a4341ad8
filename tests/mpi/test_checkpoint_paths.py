"""Ranks that pass different checkpoint paths (TensorFlow's per-worker write_filepath /
workertemp_<task_id> pattern) get a named error on every rank, listing each rank's path and saying
that all ranks write one checkpoint together (issue 16)."""

import os

import numpy as np
import pytest

import mpistrat as ms

pytestmark = pytest.mark.mpi(min_size=2)


def _write_filepath(filepath, task_type, task_id):
    """TensorFlow's multi-worker tutorial: non-chief workers write under workertemp_<id>."""
    dirpath, base = os.path.split(filepath)
    if not (task_type is None or task_type == "chief" or (task_type == "worker" and task_id == 0)):
        dirpath = os.path.join(dirpath, f"workertemp_{task_id}")
        os.makedirs(dirpath, exist_ok=True)
    return os.path.join(dirpath, base)


@pytest.fixture
def shared(world, tmp_path):
    return world.comm.bcast(str(tmp_path), root=0)


def _message_names_every_rank(err, world, paths):
    text = str(err.value)
    assert "All ranks write one checkpoint together" in text
    assert "workertemp" in text and "not needed" in text
    for rank, path in enumerate(paths):
        assert f"{path}" in text, (rank, path, text)


def test_per_worker_manager_directories_are_named(world, strategy, shared):
    resolver = strategy.cluster_resolver
    with strategy.scope():
        ckpt = ms.Checkpoint(w=ms.Variable(np.arange(3.0)))
    directory = _write_filepath(f"{shared}/ckpt", resolver.task_type, resolver.task_id)
    paths = world.comm.allgather(directory)
    with pytest.raises(ms.errors.InvalidArgumentError) as err:
        ms.CheckpointManager(ckpt, directory, max_to_keep=1)
    _message_names_every_rank(err, world, paths)
    assert "rank 1: " in str(err.value)
    # the fix the message asks for: the chief's directory on every rank
    manager = ms.CheckpointManager(ckpt, f"{shared}/ckpt", max_to_keep=1)
    assert manager.save().endswith("ckpt-1")


def test_save_write_and_restore_with_different_prefixes_raise_everywhere(world, strategy, shared):
    with strategy.scope():
        ckpt = ms.Checkpoint(w=ms.Variable(np.arange(3.0)))
    prefix = _write_filepath(f"{shared}/model", "worker", world.rank)
    paths = world.comm.allgather(prefix + "-1")
    with pytest.raises(ValueError) as err:           # InvalidArgumentError is a ValueError
        ckpt.save(prefix)
    _message_names_every_rank(err, world, paths)
    assert int(ckpt.save_counter.numpy()) == 0       # the failed save changed nothing
    with pytest.raises(ms.errors.InvalidArgumentError, match="different checkpoint paths"):
        ckpt.write(prefix)
    path = ckpt.save(f"{shared}/model")
    with pytest.raises(ms.errors.InvalidArgumentError, match="restoring checkpoint"):
        ckpt.restore(path if world.rank == 0 else f"{shared}/workertemp_{world.rank}/model-1")
    with pytest.raises(ms.errors.InvalidArgumentError, match="checkpoint directory"):
        ms.latest_checkpoint(shared if world.rank == 0 else f"{shared}/workertemp_{world.rank}")
    ckpt.restore(path).assert_consumed()


def test_relative_and_absolute_spellings_of_one_path_agree(world, strategy, shared):
    with strategy.scope():
        ckpt = ms.Checkpoint(w=ms.Variable(1.0))
    here = os.getcwd()
    os.chdir(shared)
    try:
        spelled = "rel/ckpt" if world.rank % 2 else os.path.join(shared, "rel/ckpt")
        assert ckpt.save(spelled).endswith("ckpt-1")
    finally:
        os.chdir(here)



class _Net:
    def __init__(self, value):
        self.kernel = ms.Variable(np.full((2, 3), value, np.float32))
        self.bias = ms.Variable(np.full(3, value, np.float32))


def test_a_restore_whose_paths_differ_throughout_raises_on_every_rank(world, strategy, shared):
    """Objects renamed since the save (or a TensorFlow-converted Keras file restored into a
    Keras 3 model): nothing matches. Before, restore returned a status and expect_partial()
    hid that every value stayed at its initial value."""
    path = ms.Checkpoint(model=_Net(1.0)).write(os.path.join(shared, "renamed"))
    fresh = _Net(0.0)
    with pytest.raises(ValueError, match=r"none of our 2 objects found a value among the "
                                         r"file's 2: the paths differ throughout"):
        ms.Checkpoint(network=fresh).restore(path).expect_partial()
    assert float(fresh.kernel.numpy()[0, 0]) == 0.0 and float(fresh.bias.numpy()[0]) == 0.0
    partly = ms.Checkpoint(model=_Net(0.0), extra=ms.Variable(np.zeros(2, np.float32)))
    status = partly.restore(path)                        # a partial restore stays one
    assert "extra" in status.missing_objects and "model/kernel" in status.matched
