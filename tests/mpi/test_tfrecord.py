"""TFRecordDataset under experimental_distribute_dataset at 1-4 ranks: every record once under
DATA and FILE sharding (plain and GZIP files written by TensorFlow 2.21), each rank reading
only its records under DATA, each file indexed once, hostile records raised on every rank."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import AutoShardPolicy, Options
from mpistrat.data.rebatch import rebatch_slices
from mpistrat.errors import DataLossError
from mpistrat.tfformats.records import frame

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())


@pytest.fixture
def records(world, tmp_path_factory):
    """A fresh copy of the record fixtures (a new path: indexes built anew), on every rank."""
    path = None
    if world.rank == 0:
        path = str(tmp_path_factory.mktemp("records") / "r")
        shutil.copytree(DATA / "records", path)
    return world.comm.bcast(path, root=0)


def files_of(directory, pattern):
    return sorted(str(p) for p in Path(directory).glob(pattern))


def records_of(paths):
    return [bytes.fromhex(r) for p in paths for r in REPORT["records/" + os.path.basename(p)]
            ["records"]]


def with_policy(dataset, policy):
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def local_batches(strategy, dataset):
    return [list(b.values[0]) for b in strategy.experimental_distribute_dataset(dataset)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern, compression", [("plain-*.tfrecord", None),
                                                  ("gzip-*.tfrecord.gz", "GZIP")])
@pytest.mark.parametrize("batch", [3, 8])
def test_data_sharding_reads_each_record_once(strategy, world, records, pattern, compression,
                                              batch):
    paths = files_of(records, pattern)
    everything = records_of(paths)
    reader = ms.data.TFRecordDataset(paths, compression)
    got = local_batches(strategy, with_policy(reader.batch(batch), AutoShardPolicy.DATA))
    expected = [everything[start:start + batch][a:b] for start in range(0, len(everything), batch)
                for a, b in [rebatch_slices(min(batch, len(everything) - start),
                                            world.size)[world.rank]]]
    assert got == expected
    every = [r for rank in world.comm.allgather(got) for step in rank for r in step]
    assert sorted(every) == sorted(everything)
    indexed = world.comm.allreduce(reader.files_indexed)
    assert indexed == len(paths)                     # each file indexed by one rank only
    if compression is None and world.size > 1:       # this rank read only its records
        mine = sum(len(r) + 16 for step in got for r in step)
        assert reader.bytes_read == mine
    again = ms.data.TFRecordDataset(paths, compression)
    assert local_batches(strategy, with_policy(again.batch(batch), AutoShardPolicy.DATA)) == got
    assert again.files_indexed == 0 and again.index_bytes_read > 0   # from the caches


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern, compression", [("plain-*.tfrecord", None),
                                                  ("gzip-*.tfrecord.gz", "GZIP")])
def test_file_sharding_deals_files(strategy, world, records, pattern, compression):
    paths = files_of(records, pattern)
    if len(paths) < world.size:
        with pytest.raises(ValueError, match="files"):
            local_batches(strategy, with_policy(ms.data.TFRecordDataset(paths, compression)
                                                .batch(4), AutoShardPolicy.FILE))
        return
    reader = ms.data.TFRecordDataset(paths, compression)
    got = local_batches(strategy, with_policy(reader.batch(4), AutoShardPolicy.FILE))
    mine = records_of(paths[world.rank::world.size])
    per_replica = -(-4 // world.size)
    assert [r for step in got for r in step] == mine
    assert all(len(step) <= per_replica for step in got)
    every = [r for rank in world.comm.allgather(got) for step in rank for r in step]
    assert sorted(every) == sorted(records_of(paths))
    auto = local_batches(strategy, ms.data.TFRecordDataset(paths, compression).batch(4))
    assert auto == got                                # AUTO: FILE, as many files as ranks


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("policy", [AutoShardPolicy.DATA, AutoShardPolicy.FILE])
def test_a_corrupt_record_is_raised_on_every_rank(strategy, world, records, policy):
    paths = files_of(records, "plain-*.tfrecord")[:max(world.size, 2)]
    if world.rank == 0:  # flip one byte of the second file's third record's data
        data = bytearray(open(paths[1], "rb").read())
        offsets = ms.tfformats.records.scan_offsets(paths[1])
        data[int(offsets[2]) + 14] ^= 0x01
        open(paths[1], "wb").write(bytes(data))
    world.comm.Barrier()
    dataset = with_policy(ms.data.TFRecordDataset(paths).batch(2), policy)
    if policy is AutoShardPolicy.FILE and len(paths) < world.size:
        return
    with pytest.raises(DataLossError, match="plain-1.tfrecord.*CRC-32C of its data"):
        local_batches(strategy, dataset)


@pytest.mark.mpi(min_size=1)
def test_a_file_that_cannot_be_indexed_is_raised_on_every_rank(strategy, world, records):
    paths = files_of(records, "plain-*.tfrecord")
    if world.rank == 0:
        with open(paths[-1], "ab") as handle:
            handle.write(frame(b"cut short")[:-2])
    world.comm.Barrier()
    with pytest.raises(DataLossError, match="plain-3.tfrecord.*truncated"):
        strategy.experimental_distribute_dataset(
            with_policy(ms.data.TFRecordDataset(paths).batch(4), AutoShardPolicy.DATA))


@pytest.mark.mpi(min_size=1)
def test_parsed_batches_train_like_tf_data(strategy, world, records):
    paths = files_of(records, "plain-*.tfrecord")
    features = {"x": ms.io.FixedLenFeature([3], "float32"),
                "label": ms.io.FixedLenFeature([], "int64")}
    total = 0.0
    for batch in strategy.experimental_distribute_dataset(
            with_policy(ms.data.TFRecordDataset(paths).batch(5), AutoShardPolicy.DATA)):
        examples = [r for r in batch.values[0] if r]   # the fixtures end each file with b""
        if examples:
            parsed = ms.io.parse_example(examples, features)
            total += float(parsed["x"].astype(np.float64).sum())
    every = sum(float(np.asarray(ms.io.parse_single_example(r, features)["x"], np.float64).sum())
                for r in records_of(paths) if r)
    assert np.isclose(world.comm.allreduce(total), every)
