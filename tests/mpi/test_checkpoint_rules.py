"""What a save accepts is what a restore gives back (issue 17), at 1-3 ranks.

Values that differ between ranks are refused at save, naming them and the
ranks; every dtype a save accepts restores bit for bit (raw bits plus
``mpistrat_dtype`` for ml_dtypes and datetimes); manager names are found
again; values pending for objects attached later survive rotation; ON_READ
SUM counters restore exactly; files we create never follow planted links.
"""

import os

import h5py
import ml_dtypes
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint.state_file import read_state

pytestmark = pytest.mark.numpy_only("HDF5 dtypes and in-place restores of NumPy containers")


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rules")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def _state(directory):
    return read_state(directory).model_checkpoint_path


def _refused_save(world, shared_dir, tree, name):
    """Save a good checkpoint, then ``tree``: every rank raises, the good one stays latest."""
    good = {"w": np.arange(12.0)}
    first = ms.Checkpoint(good=good).save(shared_dir + "/ckpt")
    with pytest.raises(ValueError) as info:
        ms.Checkpoint(good=good, bad=tree).save(shared_dir + "/ckpt")
    text = str(info.value)
    assert "values differ between ranks" in text and repr(name) in text, text
    assert ms.latest_checkpoint(shared_dir) == first
    assert _state(shared_dir) == os.path.basename(first)
    back = {"w": np.zeros(12)}
    ms.Checkpoint(good=back).restore(first).expect_partial()
    assert back["w"].tobytes() == good["w"].tobytes()
    return text


@pytest.mark.mpi(min_size=2)
def test_a_buffer_of_another_length_per_rank_is_refused(world, shared_dir):
    tree = {"model": np.arange(100.0), "buf": np.arange(3 + world.rank, dtype=np.float32)}
    text = _refused_save(world, shared_dir, tree, "bad/buf")
    assert "rank 0: <f4[3]" in text and "rank 1: <f4[4]" in text, text
    assert "'bad/model'" not in text  # the model agrees: only the buffer is named


@pytest.mark.mpi(min_size=2)
def test_a_float_that_differs_by_1e_9_is_refused(world, shared_dir):
    text = _refused_save(world, shared_dir, {"loss": 0.25 + 1e-9 * world.rank}, "bad/loss")
    assert "rank 0:" in text and "rank 1:" in text


@pytest.mark.mpi(min_size=3)
def test_the_ranks_that_differ_are_named(world, shared_dir):
    text = _refused_save(world, shared_dir, {"x": np.float32(world.rank == 1)}, "bad/x")
    others = ", ".join(str(r) for r in range(world.size) if r != 1)
    assert f"ranks {others}: <f4[]" in text, text  # ranks 0, 2: ...; rank 1: ...
    assert "rank 1: <f4[]" in text, text


@pytest.mark.mpi(min_size=2)
def test_a_large_array_of_the_rank_id_is_refused(world, shared_dir):
    ids = np.full((world.size * 64, 4096), world.rank, dtype=np.float64)  # 2 MiB a rank: partitions
    _refused_save(world, shared_dir, {"ids": ids}, "bad/ids")


@pytest.mark.mpi(min_size=1)
def test_equal_values_save_at_one_cost(world, shared_dir):
    tree = {"a": np.ones((world.size * 40, 4096)), "n": 3, "x": 0.5}
    path = ms.Checkpoint(tree=tree).save(shared_dir + "/ckpt")
    assert ms.latest_checkpoint(shared_dir) == path


def _dtype_values():
    return {"bf16": np.linspace(-2, 2, 9).astype(ml_dtypes.bfloat16),
            "f8e4m3": np.linspace(-3, 3, 7).astype(ml_dtypes.float8_e4m3fn),
            "f8e5m2": np.linspace(-3, 3, 7).astype(ml_dtypes.float8_e5m2),
            "int4": np.array([-8, -1, 0, 7], dtype=ml_dtypes.int4),
            "uint4": np.array([0, 15], dtype=ml_dtypes.uint4),
            "big": (np.arange(6) / 3).astype(">f8"), "big_i": np.arange(3, dtype=">i4"),
            "big_large": np.arange(300000, dtype=">f8"),
            "when": np.array(["2020-01-01T00:00:00.5", "NaT"], dtype="M8[ms]"),
            "delta": np.array([1, -2], dtype="m8[s]"), "half": np.ones(3, np.float16),
            "scalar_bf16": np.array(1.5, dtype=ml_dtypes.bfloat16), "c": np.arange(3) * 1j}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["parallel", "parts"])
def test_every_accepted_dtype_round_trips_bit_for_bit(world, shared_dir, mode, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CHECKPOINT_MODE", mode)
    want = _dtype_values()
    with ms.MultiWorkerMirroredStrategy().scope():
        var = ms.Variable(np.arange(4).astype(ml_dtypes.bfloat16))
    path = ms.Checkpoint(tree={k: v.copy() for k, v in want.items()}, var=var).save(
        shared_dir + "/ckpt")
    if world.rank == 0:  # h5py shows what they are: raw bits named by mpistrat_dtype
        with h5py.File(path + ".h5") as f:
            assert f["tree/bf16"].dtype == np.uint16
            assert f["tree/bf16"].attrs["mpistrat_dtype"] == "bfloat16"
            assert f["tree/int4"].attrs["mpistrat_dtype"] == "int4"
            assert f["tree/when"].dtype == np.int64
            assert f["tree/when"].attrs["mpistrat_dtype"] == "datetime64[ms]"
            assert f["tree/big"].dtype == np.dtype(">f8")
    fresh = {k: np.zeros_like(v) for k, v in want.items()}
    var.assign(np.zeros(4, ml_dtypes.bfloat16))
    ms.Checkpoint(tree=fresh, var=var).restore(path).assert_consumed()
    for k, v in want.items():
        assert fresh[k].dtype == v.dtype and fresh[k].tobytes() == v.tobytes(), k
    assert var.numpy().tobytes() == np.arange(4).astype(ml_dtypes.bfloat16).tobytes()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("value", [np.array(["text"]), np.array([object()]),
                                   np.zeros(2, dtype=[("a", "<i4")]), 2 ** 70])
def test_unrestorable_dtypes_are_refused_at_save_naming_the_path(world, shared_dir, value):
    first = ms.Checkpoint(w={"x": np.ones(2)}).save(shared_dir + "/ckpt")
    with pytest.raises(TypeError, match="'tree/v'"):
        ms.Checkpoint(w={"x": np.ones(2)}, tree={"v": value}).save(shared_dir + "/ckpt")
    assert ms.latest_checkpoint(shared_dir) == first


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["model ckpt", "模型", "ckpt"])
def test_every_accepted_manager_name_is_found_after_a_restart(world, shared_dir, name):
    w = {"w": np.arange(5.0)}
    manager = ms.CheckpointManager(ms.Checkpoint(tree=w), shared_dir, max_to_keep=2,
                                   checkpoint_name=name)
    saved = [manager.save() for _ in range(3)]
    back = {"w": np.zeros(5)}
    again = ms.CheckpointManager(ms.Checkpoint(tree=back), shared_dir, max_to_keep=2,
                                 checkpoint_name=name)  # a restart
    assert again.restore_or_initialize() == saved[-1]
    assert again.checkpoints == saved[1:]
    assert back["w"].tobytes() == w["w"].tobytes()
    assert ms.latest_checkpoint(shared_dir) == saved[-1]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["best/ckpt", "", ".hidden", "a\nb"])
def test_a_manager_name_it_could_not_find_again_is_refused(world, shared_dir, name):
    with pytest.raises(ValueError, match="checkpoint_name"):
        ms.CheckpointManager(ms.Checkpoint(w=np.ones(2)), shared_dir, max_to_keep=1,
                             checkpoint_name=name)


class Slots:
    """An optimizer's slots: attached after the restore."""


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["parallel", "parts"])
def test_values_pending_after_restore_survive_rotation(world, shared_dir, mode, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CHECKPOINT_MODE", mode)
    slots = Slots()
    slots.m = np.arange(float(1 << 18))  # 2 MiB: partitions written by every rank
    slots.v = np.full(7, 3.5)
    model = {"w": np.ones(4)}
    ms.CheckpointManager(ms.Checkpoint(model=model, slots=slots), shared_dir, max_to_keep=1).save()
    fresh = ms.Checkpoint(model={"w": np.zeros(4)})
    manager = ms.CheckpointManager(fresh, shared_dir, max_to_keep=1)
    restored = manager.restore_or_initialize()
    manager.save()  # max_to_keep=1: deletes the restored checkpoint
    assert not os.path.exists(restored + ".h5")
    later = Slots()
    later.m, later.v = np.zeros(1 << 18), np.zeros(7)
    fresh.slots = later  # attached now: values read from the restored file, still open
    assert later.m.tobytes() == slots.m.tobytes() and later.v.tobytes() == slots.v.tobytes()


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_committed_under_the_same_name_during_a_restore(world, shared_dir,
                                                                     monkeypatch):
    from mpistrat.checkpoint import h5format as checkpoint_module   # (where restore reads)
    old = {"w": np.arange(float(1 << 18)), "b": np.arange(3.0)}
    path = ms.Checkpoint(tree=old).write(shared_dir + "/ckpt")
    other = ms.Checkpoint(tree={"w": -np.arange(float(1 << 18)), "b": np.zeros(3)}).write(
        shared_dir + "/other")
    read_values = checkpoint_module.read_values

    def commit_meanwhile(final, reader, paths):  # between the catalog and the data
        if world.rank == 0 and os.path.exists(other + ".h5"):
            os.replace(other + ".h5", final)  # the rename a save makes under the same name
        world.comm.Barrier()
        return read_values(final, reader, paths)

    monkeypatch.setattr(checkpoint_module, "read_values", commit_meanwhile)
    back = {"w": np.zeros(1 << 18), "b": np.zeros(3)}
    ms.Checkpoint(tree=back).restore(path).assert_consumed()
    assert back["w"].tobytes() == old["w"].tobytes() and back["b"].tobytes() == old["b"].tobytes()


@pytest.mark.mpi(min_size=1)
def test_an_int64_on_read_sum_counter_restores_exactly(strategy, world, shared_dir):
    with strategy.scope():
        counter = ms.Variable(np.int64(0), synchronization=ms.VariableSynchronization.ON_READ,
                              aggregation=ms.VariableAggregation.SUM)
    mine = 5 if world.rank == 0 else 0  # 5 in all, however many ranks
    strategy.run(lambda: counter.assign(np.int64(mine)))
    with strategy.scope():  # cross-replica context: reads give the SUM
        assert int(counter.numpy()) == 5
        path = ms.Checkpoint(counter=counter).save(shared_dir + "/ckpt")
        counter.assign(np.int64(0))  # a cross-replica assign splits exactly too
        assert int(counter.numpy()) == 0
        ms.Checkpoint(counter=counter).restore(path).assert_consumed()
        assert int(counter.numpy()) == 5 and counter.dtype == np.int64
        shares = world.comm.allgather(int(counter._value))  # an exact split over the replicas
        assert sum(shares) == 5 and max(shares) - min(shares) <= 1, shares
        counter.assign(np.int64(-7))
        assert int(counter.numpy()) == -7


@pytest.mark.mpi(min_size=1)
def test_a_planted_symlink_never_makes_a_save_write_outside(world, shared_dir, tmp_path):
    outside = os.path.join(shared_dir, "..", f"victim-{os.path.basename(shared_dir)}")
    run = os.path.join(shared_dir, "run")
    if world.rank == 0:
        os.makedirs(run)
        with open(outside, "wb") as handle:
            handle.write(b"precious")
        os.symlink(outside, os.path.join(run, f".checkpoint.tmp-{os.getpid()}"))  # the old name
    world.comm.Barrier()
    w = {"w": np.arange(4.0)}
    manager = ms.CheckpointManager(ms.Checkpoint(tree=w), run, max_to_keep=2)
    paths = [manager.save(), ms.Checkpoint(tree=w).save(run + "/other")]
    assert ms.latest_checkpoint(run) == paths[1]
    world.comm.Barrier()
    if world.rank == 0:
        assert open(outside, "rb").read() == b"precious"
        from mpistrat.checkpoint.files import create_exclusive
        planted = os.path.join(run, ".ckpt-9.h5.tmp-" + "0" * 32)
        os.symlink(outside, planted)
        with pytest.raises(FileExistsError):
            create_exclusive(planted)  # how every file of ours is created
        assert open(outside, "rb").read() == b"precious"
        os.remove(outside)


# -- a restore agrees its plan across ranks (issue 33): a rank-local mismatch raises everywhere --
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["shape", "dtype", "extra object"])
def test_a_mismatch_on_one_rank_raises_on_every_rank(world, shared_dir, how):
    """Before, the last rank raised and the others waited forever in the collective read."""
    saved = {"w": np.arange(12.0), "b": np.arange(3.0)}
    path = ms.Checkpoint(model=saved).save(shared_dir + "/ckpt")
    odd = world.rank == world.size - 1
    target = {"w": np.zeros(12), "b": np.zeros(3)}
    if odd and how == "shape":
        target["w"] = np.zeros(13)
    elif odd and how == "dtype":
        target["w"] = np.zeros(12, np.float32)
    checkpoint = ms.Checkpoint(model=target)
    if how == "extra object":
        checkpoint.extra = {"v": np.zeros(2)} if odd else {}
        ms.Checkpoint(model=saved, extra={"v": np.ones(2)}).write(shared_dir + "/with-extra")
        path = shared_dir + "/with-extra"
    with pytest.raises(ValueError) as info:
        checkpoint.restore(path)
    text = str(info.value)
    assert f"rank {world.size - 1}" in text, text
    assert ("'model/w'" in text) if how != "extra object" else ("extra/v" in text), text
    assert not target["w"].any() and not target["b"].any()   # nothing was read into any rank


@pytest.mark.mpi(min_size=2)
def test_a_tensorflow_restore_with_a_mismatch_on_one_rank_raises_on_every_rank(world):
    from pathlib import Path
    data = Path(__file__).resolve().parent.parent / "data" / "tf"

    class Dense:
        def __init__(self, units):
            self.kernel = ms.Variable(np.zeros((3, units), np.float32))
            self.bias = ms.Variable(np.zeros(4, np.float32))

    class Net:
        pass
    net = Net()
    net.dense = Dense(5 if world.rank == world.size - 1 else 4)
    with pytest.raises(ValueError) as info:
        ms.Checkpoint(model=net).restore(str(data / "module/ckpt-1"))
    text = str(info.value)
    assert f"rank {world.size - 1}" in text and "'model/dense/kernel'" in text, text
    assert not net.dense.bias.numpy().any()


def _open_files_under(directory):
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [link for link in links if link.startswith(os.path.realpath(directory))]


@pytest.mark.mpi(min_size=1)
def test_a_restore_that_matched_everything_keeps_no_checkpoint_file_open(world, shared_dir):
    """A rotated-away checkpoint must not stay open (its space held, NFS's .nfs files): once
    every value found its object, the restore lets go of the file; values left pending keep
    it open while their checkpoint lives."""
    import gc
    path = ms.Checkpoint(tree={"w": np.arange(4.0), "b": np.ones(2)}).write(
        shared_dir + "/ckpt")
    full = ms.Checkpoint(tree={"w": np.zeros(4), "b": np.zeros(2)})
    full.restore(path).assert_consumed()
    gc.collect()
    assert _open_files_under(shared_dir) == []
    partial = ms.Checkpoint(tree={"w": np.zeros(4)})
    partial.restore(path)
    assert _open_files_under(shared_dir) != []     # "b" waits for its object
    del partial
    gc.collect()
    assert _open_files_under(shared_dir) == []
