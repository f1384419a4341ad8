"""File readers distributed at 1-4 ranks: FILE and DATA sharding, bytes read, bad input."""

import os

import h5py
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import AutoShardPolicy, FixedLengthRecordDataset, NpyDataset, Options

pytestmark = pytest.mark.numpy_only("file readers over MPI-IO yield NumPy")


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def record_files(world, directory, files=4, per_file=5):
    paths = [os.path.join(directory, f"part-{i}.bin") for i in range(files)]
    if world.rank == 0:
        for i, path in enumerate(paths):
            np.arange(i * per_file, (i + 1) * per_file, dtype=np.int32).tofile(path)
    world.comm.Barrier()
    return paths


def with_policy(dataset, policy):
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def batches(strategy, dataset):
    return [b.values[0].tolist() for b in strategy.experimental_distribute_dataset(dataset)]


@pytest.mark.mpi(min_size=2)
def test_file_sharding_matches_tensorflow(strategy, world, shared_dir):
    if world.size != 2:
        pytest.skip("measured at 2 ranks")
    reader = FixedLengthRecordDataset(record_files(world, shared_dir), 4, dtype=np.int32)
    got = batches(strategy, with_policy(reader.batch(6), AutoShardPolicy.FILE))
    want = {0: [[0, 1, 2], [3, 4, 10], [11, 12, 13], [14]],
            1: [[5, 6, 7], [8, 9, 15], [16, 17, 18], [19]]}[world.rank]
    assert got == want
    assert reader.bytes_read == 10 * 4  # only its own two files


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("batch", [3, 5, 7])
def test_data_sharding_reads_only_the_rows_a_rank_keeps(strategy, world, shared_dir, batch):
    reader = FixedLengthRecordDataset(record_files(world, shared_dir, files=3, per_file=7),
                                      record_bytes=4, dtype=np.int32)
    got = batches(strategy, with_policy(reader.batch(batch), AutoShardPolicy.DATA))
    expected = [list(range(start, min(start + batch, 21)))[a:b]
                for start in range(0, 21, batch)
                for a, b in [ms.data.rebatch.rebatch_slices(min(batch, 21 - start),
                                                            world.size)[world.rank]]]
    assert got == expected
    assert reader.bytes_read == 4 * sum(len(rows) for rows in expected)
    assert world.comm.allreduce(reader.bytes_read) == 21 * 4  # every byte read exactly once


@pytest.mark.mpi(min_size=1)
def test_auto_picks_file_when_there_are_enough_files(strategy, world, shared_dir):
    paths = record_files(world, shared_dir, files=4, per_file=5)
    reader = FixedLengthRecordDataset(paths, 4, dtype=np.int32)
    got = batches(strategy, reader.batch(4))
    everyone = world.comm.allgather(got)
    assert sorted(x for steps in everyone for b in steps for x in b) == list(range(20))
    assert len({len(steps) for steps in everyone}) == 1
    if world.size <= 4:
        assert reader.bytes_read == 4 * 5 * len(paths[world.rank::world.size])


@pytest.mark.mpi(min_size=2)
def test_file_policy_with_fewer_files_than_ranks_is_an_error(strategy, world, shared_dir):
    reader = FixedLengthRecordDataset(record_files(world, shared_dir, files=1), 4, dtype=np.int32)
    with pytest.raises(ValueError, match=f"1 files for {world.size} ranks"):
        strategy.experimental_distribute_dataset(with_policy(reader.batch(2), AutoShardPolicy.FILE))


@pytest.mark.mpi(min_size=1)
def test_bad_record_files(world, shared_dir):
    path = os.path.join(shared_dir, "odd.bin")
    if world.rank == 0:
        np.arange(5, dtype=np.int16).tofile(path)  # 10 bytes
    world.comm.Barrier()
    with pytest.raises(ValueError, match="odd.bin: 10 bytes is not header 0"):
        FixedLengthRecordDataset([path], record_bytes=4)
    assert len(list(FixedLengthRecordDataset([path], 4, header_bytes=2))) == 2
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        FixedLengthRecordDataset([os.path.join(shared_dir, "missing.bin")], 4)


@pytest.mark.mpi(min_size=1)
def test_npy_and_hdf5_readers(strategy, world, shared_dir):
    paths = [os.path.join(shared_dir, f"x{i}.npy") for i in range(2)]
    h5path = os.path.join(shared_dir, "x.h5")
    if world.rank == 0:
        for i, path in enumerate(paths):
            np.save(path, np.arange(12, dtype=np.float32).reshape(6, 2) + 100 * i)
        with h5py.File(h5path, "w") as f:
            f["x"] = np.arange(8).reshape(4, 2)
    world.comm.Barrier()
    reader = NpyDataset(paths)
    rows = [r.tolist() for r in reader]
    assert rows[0] == [0.0, 1.0] and rows[6] == [100.0, 101.0] and len(rows) == 12
    gathered = strategy.gather(np.concatenate(
        [b.values[0] for b in strategy.experimental_distribute_dataset(
            with_policy(reader.batch(4), AutoShardPolicy.DATA))] or [np.empty((0, 2), np.float32)]),
        axis=0)
    assert sorted(gathered[:, 0].tolist()) == sorted(r[0] for r in rows)
    assert [r.tolist() for r in ms.data.HDF5Dataset(h5path, "x")][3] == [6, 7]
    h5reader = ms.data.HDF5Dataset(h5path, "x")
    mine = [b.values[0].tolist() for b in strategy.experimental_distribute_dataset(
        with_policy(h5reader.batch(4), AutoShardPolicy.DATA))]
    kept = sum(len(b) for b in mine)
    assert h5reader.bytes_read == kept * 2 * 8  # only the rows this rank keeps
    assert world.comm.allreduce(kept) == 4
    with pytest.raises(FileNotFoundError):
        ms.data.HDF5Dataset(h5path, "nope")


@pytest.mark.mpi(min_size=1)
def test_a_file_truncated_under_one_rank_raises_on_every_rank(strategy, world, shared_dir):
    path = os.path.join(shared_dir, "trunc.bin")
    if world.rank == 0:
        np.arange(4000, dtype=np.int32).tofile(path)
    world.comm.Barrier()
    dataset = ms.data.FixedLengthRecordDataset([path], record_bytes=4, dtype=np.int32)
    batches = iter(strategy.experimental_distribute_dataset(dataset.batch(400 * world.size)))
    next(batches)  # the first global batch reads fine everywhere
    world.comm.Barrier()
    if world.rank == 0:
        os.truncate(path, 4 * 400 * world.size + 8)  # the last rank's next rows are gone
    world.comm.Barrier()
    with pytest.raises(ms.errors.DataLossError, match=rf"rank {world.size - 1}: reading its "
                                                      rf"input.*short read"):
        next(batches)


@pytest.mark.mpi(min_size=1)
def test_a_file_that_grew_after_the_dataset_was_built_is_refused_on_every_rank(strategy, world,
                                                                               shared_dir):
    """The record count is taken when the dataset is built: distributing it after the file
    changed (a writer still appending) is an error naming the file on every rank, not a
    stale count."""
    paths = record_files(world, shared_dir, files=1, per_file=8)
    dataset = FixedLengthRecordDataset(paths, 4).batch(2)
    world.comm.Barrier()
    if world.rank == 0:
        with open(paths[0], "ab") as f:
            f.write(np.arange(4, dtype=np.int32).tobytes())
    world.comm.Barrier()
    with pytest.raises(ValueError, match=r"part-0\.bin changed after its dataset was built"):
        strategy.experimental_distribute_dataset(dataset)
    again = FixedLengthRecordDataset(paths, 4).batch(2)   # built afresh: 12 records
    mine = sum(len(b) for b in batches(strategy, again))
    assert world.comm.allreduce(mine) == 12
