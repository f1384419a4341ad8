"""Checkpoints at 1-4 ranks: round trips, layout, manager, errors, async saves."""

import os

import h5py
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint.state_file import read_state

pytestmark = pytest.mark.numpy_only(
    "HDF5 layout and in-place restores of NumPy containers (other kinds: "
    "test_checkpoint_kinds.py, tests/gpu)")


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0 picks it)."""
    path = str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


class Dense:
    def __init__(self, rows, cols, seed):
        self.kernel = ms.Variable(np.random.default_rng(seed).standard_normal((rows, cols)))
        self.bias = ms.Variable(np.zeros(cols, dtype=np.float32))


class Counter:
    """An object that follows the state protocol."""

    def __init__(self):
        self.count = 0

    def _serialize_to_tensors(self):
        return {"count": np.array(self.count, dtype=np.int64)}

    def _restore_from_tensors(self, tensors):
        self.count = int(tensors["count"])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["parallel", "parts"])
def test_save_restore_round_trip_of_every_kind(strategy, world, shared_dir, mode, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CHECKPOINT_MODE", mode)
    with strategy.scope():
        model = Dense(2000, 300, seed=1)  # 4.8 MB: one partition per rank
        total = ms.Variable(0.0, synchronization=ms.VariableSynchronization.ON_READ,
                            aggregation=ms.VariableAggregation.SUM)
    strategy.run(lambda: total.assign_add(1.0))
    extra = {"table": np.arange(12, dtype=np.int32).reshape(3, 4), "lr": 0.5, "flags": [True, 3]}
    counter = Counter()
    counter.count = 7
    ckpt = ms.Checkpoint(model=model, extra=extra, total=total, counter=counter, step=5)
    path = ckpt.save(os.path.join(shared_dir, "ckpt"))
    assert path.endswith("ckpt-1") and int(ckpt.save_counter.numpy()) == 1
    assert ms.latest_checkpoint(shared_dir) == path
    want_kernel = model.kernel.numpy()
    model.kernel.assign(np.zeros((2000, 300)))
    extra["table"][:] = -1
    extra["lr"], extra["flags"][0], extra["flags"][1] = 0.0, False, 0
    counter.count = 0
    status = ckpt.restore(path)
    status.assert_consumed().assert_nontrivial_match()
    np.testing.assert_array_equal(model.kernel.numpy(), want_kernel)
    assert extra["table"].tolist() == np.arange(12).reshape(3, 4).tolist()
    assert extra["lr"] == 0.5 and type(extra["lr"]) is float
    assert extra["flags"] == [True, 3] and counter.count == 7
    with strategy.scope():
        assert float(total) == pytest.approx(world.size)  # ON_READ SUM reads back the sum
    with h5py.File(path + ".h5", "r") as f:  # readable without mpistrat
        assert f["model/kernel"].shape == (2000, 300)
        parts = f["model/kernel"].attrs["mpistrat_partitions"]
        assert len(parts) == world.size and parts[-1][1] == 2000
        assert f.attrs["mpistrat_format_version"] == 2
    with open(path + ".h5", "rb") as raw:  # the marker that proves the file is ours
        assert raw.read(25) == b"mpistrat checkpoint file\n"


@pytest.mark.mpi(min_size=1)
def test_write_read_and_state_file(world, shared_dir):
    v = ms.Variable(np.arange(4.0))
    ckpt = ms.Checkpoint(v=v)
    written = ckpt.write(os.path.join(shared_dir, "plain"))
    assert ms.latest_checkpoint(shared_dir) is None  # write() touches no state file
    assert int(ckpt.save_counter.numpy()) == 0
    v.assign(np.zeros(4))
    ckpt.read(written).assert_consumed()
    assert v.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    first = ckpt.save(os.path.join(shared_dir, "ckpt"))
    second = ckpt.save(os.path.join(shared_dir, "ckpt"))
    state = read_state(shared_dir)
    assert state.model_checkpoint_path == "ckpt-2"
    assert state.all_model_checkpoint_paths == ["ckpt-1", "ckpt-2"]
    assert ms.latest_checkpoint(shared_dir) == second and first.endswith("-1")
    with pytest.raises(ms.errors.NotFoundError, match="-N' suffix"):
        ckpt.restore(os.path.join(shared_dir, "ckpt"))
    with pytest.raises(FileNotFoundError):
        ckpt.restore(os.path.join(shared_dir, "nothing-9"))
    assert ms.latest_checkpoint(os.path.join(shared_dir, "empty")) is None


@pytest.mark.mpi(min_size=1)
def test_mismatch_names_the_object_path(world, shared_dir):
    path = ms.Checkpoint(net={"w": ms.Variable(np.ones(3))}).save(shared_dir + "/ckpt")
    with pytest.raises(ValueError, match="'net/w'.*float64\\[3\\].*float64\\[4\\]"):
        ms.Checkpoint(net={"w": ms.Variable(np.ones(4))}).restore(path)
    with pytest.raises(ValueError, match="'net/w'.*float32"):
        ms.Checkpoint(net={"w": ms.Variable(np.ones(3, np.float32))}).restore(path)


@pytest.mark.mpi(min_size=1)
def test_deferred_restore_and_partial_status(world, shared_dir):
    path = ms.Checkpoint(a=ms.Variable(1.0), b=ms.Variable(2.0)).save(shared_dir + "/ckpt")
    ckpt = ms.Checkpoint(a=ms.Variable(0.0), c=ms.Variable(9.0))
    status = ckpt.restore(path)
    with pytest.raises(AssertionError, match="'b'"):
        status.assert_consumed()
    with pytest.raises(AssertionError, match="'c'"):
        status.assert_existing_objects_matched()
    status.assert_nontrivial_match().expect_partial()
    ckpt.b = ms.Variable(0.0)           # attached after the restore: gets its value now
    assert float(ckpt.b) == 2.0 and float(ckpt.a) == 1.0
    with pytest.raises(AssertionError):
        ms.Checkpoint().restore(None).assert_consumed()


@pytest.mark.mpi(min_size=1)
def test_flipped_byte_raises_data_loss_naming_the_object(world, shared_dir):
    ckpt = ms.Checkpoint(big=ms.Variable(np.arange(300_000, dtype=np.float64)),
                         small=ms.Variable(np.ones(3)))
    path = ckpt.save(shared_dir + "/ckpt")
    if world.rank == 0:
        with h5py.File(path + ".h5", "r") as f:
            offset = f["big"].id.get_offset()
        with open(path + ".h5", "r+b") as raw:
            raw.seek(offset + 8 * 150_001)
            byte = raw.read(1)
            raw.seek(offset + 8 * 150_001)
            raw.write(bytes([byte[0] ^ 0xFF]))
    world.comm.Barrier()
    with pytest.raises(ms.errors.DataLossError, match="'big'"):
        ckpt.restore(path)
    if world.rank == 0:
        with open(path + ".h5", "r+b") as raw:
            raw.truncate(100)
    world.comm.Barrier()
    with pytest.raises(ms.errors.DataLossError, match="could not be read"):
        ckpt.restore(path)
    if world.rank == 0:
        with open(shared_dir + "/junk-1.h5", "w") as handle:
            handle.write("not hdf5")
    world.comm.Barrier()
    with pytest.raises(ms.errors.DataLossError):
        ckpt.restore(shared_dir + "/junk-1")


@pytest.mark.mpi(min_size=1)
def test_manager_keeps_max_and_reloads(world, shared_dir):
    step = ms.Variable(np.int64(0))
    manager = ms.CheckpointManager(ms.Checkpoint(step=step), shared_dir, max_to_keep=2)
    assert manager.restore_or_initialize() is None
    for _ in range(4):
        step.assign_add(1)
        manager.save()
    names = [os.path.basename(p) for p in manager.checkpoints]
    assert names == ["ckpt-3", "ckpt-4"]
    world.comm.Barrier()
    on_disk = sorted(n for n in os.listdir(shared_dir) if n.endswith(".h5"))
    assert on_disk == ["ckpt-3.h5", "ckpt-4.h5"]
    step2 = ms.Variable(np.int64(0))
    again = ms.CheckpointManager(ms.Checkpoint(step=step2), shared_dir, max_to_keep=2)
    assert again.checkpoints == manager.checkpoints
    assert again.restore_or_initialize() == manager.latest_checkpoint and int(step2) == 4
    assert manager.save(checkpoint_number=100).endswith("ckpt-100")


@pytest.mark.mpi(min_size=1)
def test_manager_interval(world, shared_dir):
    step = ms.Variable(np.int64(0))
    manager = ms.CheckpointManager(ms.Checkpoint(step=step), shared_dir, max_to_keep=None,
                                   step_counter=step, checkpoint_interval=3)
    saved = []
    for _ in range(7):
        saved.append(manager.save() is not None)
        step.assign_add(1)
    assert saved == [True, False, False, True, False, False, True]


@pytest.mark.mpi(min_size=1)
def test_async_save_overlaps_training_collectives(strategy, world, shared_dir):
    with strategy.scope():
        weights = ms.Variable(np.ones(2_000_000), aggregation=ms.VariableAggregation.MEAN)
    ckpt = ms.Checkpoint(weights=weights)
    path = ckpt.save(shared_dir + "/ckpt", options=ms.CheckpointOptions(enable_async=True))
    for _ in range(20):  # training goes on while the background thread writes
        strategy.run(lambda: weights.assign_add(np.ones(2_000_000)))
        assert strategy.reduce("SUM", 1.0, axis=None) == world.size
    ckpt.sync()
    assert ms.latest_checkpoint(shared_dir) == path
    ckpt.restore(path).assert_consumed()
    assert weights.numpy()[0] == 1.0  # the value staged when save() returned


@pytest.mark.mpi(min_size=1)
def test_async_error_surfaces_at_sync_on_every_rank(world, shared_dir):
    if world.rank == 0:
        os.makedirs(os.path.join(shared_dir, "ckpt-1.h5"))  # the commit's rename will fail
    world.comm.Barrier()
    ckpt = ms.Checkpoint(v=ms.Variable(1.0))
    ckpt.save(shared_dir + "/ckpt", options=ms.CheckpointOptions(enable_async=True))
    with pytest.raises(OSError, match="committing .*ckpt-1.h5"):
        ckpt.sync()
    ckpt.sync()  # the error is reported once
    assert int(ckpt.save_counter.numpy()) == 0  # a failed save does not count


@pytest.mark.mpi(min_size=1)
def test_unusable_directory_raises_on_every_rank(world, shared_dir):
    blocker = os.path.join(shared_dir, "file")
    if world.rank == 0:
        open(blocker, "w").close()
    world.comm.Barrier()
    with pytest.raises(OSError, match="preparing .*file: FileExistsError"):
        ms.Checkpoint(v=ms.Variable(1.0)).save(os.path.join(blocker, "ckpt"))


@pytest.mark.mpi(min_size=1)
def test_crafted_files_raise_on_every_rank(world, shared_dir, monkeypatch):
    ckpt = ms.Checkpoint(w=ms.Variable(np.arange(1_000_000.0)))   # 8 MB: a partition per rank
    path = ckpt.save(shared_dir + "/ckpt")
    if world.rank == 0:  # partitions that overlap: rows 0..k are claimed twice
        with h5py.File(path + ".h5", "r+") as f:
            parts = f["w"].attrs["mpistrat_partitions"]
            parts[-1][0] -= 1 if len(parts) > 1 else 0
            parts[0][1] += 1 if len(parts) == 1 else 0
            f["w"].attrs["mpistrat_partitions"] = parts
    world.comm.Barrier()
    with pytest.raises(ms.errors.DataLossError, match=r"object 'w'.*partition"):
        ckpt.restore(path)
    monkeypatch.setenv("MPISTRAT_CHECKPOINT_MODE", "parts")
    path = ckpt.save(shared_dir + "/parts")
    world.comm.Barrier()
    if world.rank == 0:
        os.remove([os.path.join(shared_dir, n) for n in sorted(os.listdir(shared_dir))
                   if n.startswith("parts-") and ".part-" in n][-1])
    world.comm.Barrier()
    with pytest.raises(ms.errors.NotFoundError, match=r"part file .* of checkpoint"):
        ckpt.restore(path)


@pytest.mark.mpi(min_size=1)
def test_a_large_value_in_fewer_partitions_than_ranks_restores_everywhere(world, shared_dir):
    want = np.arange(200_000, dtype=np.float64)                 # 1.6 MB: one partition
    ckpt = ms.Checkpoint(w=ms.Variable(want.copy()), big=ms.Variable(np.arange(1_000_000.0)))
    path = ckpt.save(shared_dir + "/ckpt")
    ckpt.w.assign(np.zeros_like(want))
    ckpt.big.assign(np.zeros(1_000_000))
    ckpt.restore(path).assert_consumed()
    np.testing.assert_array_equal(ckpt.w.numpy(), want)
    np.testing.assert_array_equal(ckpt.big.numpy(), np.arange(1_000_000.0))
