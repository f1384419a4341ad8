"""TPUStrategy input: per-device batches with static shapes, from datasets and readers."""

import os

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import AutoShardPolicy, Dataset, Options
from conftest import DEVICES_PER_HOST

pytestmark = pytest.mark.mpi(min_size=1)


def test_upstream_dataset_example(strategy):
    n = strategy.num_replicas_in_sync
    dataset = Dataset.range(2 * n).batch(n, drop_remainder=True)   # one row per replica
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_fn(x):
        return x * 2

    result = [strategy.run(replica_fn, args=(x,)) for x in dist_dataset]
    assert len(result) == 2
    ids = strategy.extended.local_replica_ids
    for step, per_replica in enumerate(result):
        assert per_replica.replica_ids == ids
        got = [np.asarray(v).tolist() for v in strategy.experimental_local_results(per_replica)]
        assert got == [[2 * (step * n + rid)] for rid in ids]


def test_each_device_gets_its_rows_of_every_global_batch(strategy):
    n = strategy.num_replicas_in_sync
    per_replica, steps = 3, 4
    dataset = Dataset.range(steps * n * per_replica + 5).batch(n * per_replica,
                                                               drop_remainder=True)
    seen = 0
    for step, batch in enumerate(strategy.experimental_distribute_dataset(dataset)):
        assert len(batch.values) == DEVICES_PER_HOST
        for rid, rows in zip(batch.replica_ids, batch.values):
            first = step * n * per_replica + rid * per_replica
            assert rows.tolist() == list(range(first, first + per_replica))
        np.testing.assert_array_equal(  # and the whole global batch, in replica order
            strategy.gather(batch, axis=0),
            np.arange(step * n * per_replica, (step + 1) * n * per_replica))
        seen += 1
    assert seen == steps  # the 5 rows of the short batch are dropped, as asked


def test_short_batches_and_uneven_splits_are_refused(strategy):
    n = strategy.num_replicas_in_sync
    with pytest.raises(ValueError, match="drop_remainder=True"):
        strategy.experimental_distribute_dataset(Dataset.range(4 * n).batch(n))
    with pytest.raises(ValueError, match="not divisible"):
        strategy.experimental_distribute_dataset(
            Dataset.range(4 * n).batch(n + 1, drop_remainder=True))
    with pytest.raises(ValueError, match="drop_remainder=True"):
        strategy.distribute_datasets_from_function(lambda ctx: Dataset.range(10).batch(3))


def test_datasets_from_function_feed_one_batch_per_device(strategy, world):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        batch = ctx.get_per_replica_batch_size(2 * ctx.num_replicas_in_sync)
        start = 1000 * ctx.input_pipeline_id
        return Dataset.range(start, start + 9 * batch).batch(batch, drop_remainder=True)

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    (ctx,) = contexts
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == \
        (world.size, world.rank, strategy.num_replicas_in_sync)
    assert len(batches) == 9 // DEVICES_PER_HOST   # a partial group of batches ends it
    first = 1000 * world.rank
    for step, batch in enumerate(batches):
        for i, rows in enumerate(batch.values):
            start = first + 2 * (step * DEVICES_PER_HOST + i)
            assert rows.tolist() == [start, start + 1]


def test_a_reader_feeds_devices_reading_only_their_rows(strategy, world, shared_dir):
    n = strategy.num_replicas_in_sync
    path = os.path.join(shared_dir, "records.bin")
    if world.rank == 0:
        np.arange(n * 6, dtype=np.int32).tofile(path)
    world.comm.Barrier()
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    reader = ms.data.FixedLengthRecordDataset([path], 4, dtype=np.int32, shape=())
    dataset = reader.batch(2 * n, drop_remainder=True).with_options(options)
    steps = list(strategy.experimental_distribute_dataset(dataset))
    assert len(steps) == 3
    for step, batch in enumerate(steps):
        for rid, rows in zip(batch.replica_ids, batch.values):
            start = step * 2 * n + 2 * rid
            assert rows.tolist() == [start, start + 1]
    assert reader.bytes_read == 3 * 2 * DEVICES_PER_HOST * 4


def test_iterator_position_is_checkpointed(strategy, shared_dir):
    n = strategy.num_replicas_in_sync
    dataset = Dataset.range(5 * n).batch(n, drop_remainder=True)
    first = iter(strategy.experimental_distribute_dataset(dataset))
    next(first), next(first)
    ckpt = ms.Checkpoint(iterator=first)
    path = ckpt.write(os.path.join(shared_dir, "it"))
    rest = [b.values[0].tolist() for b in first]
    resumed = iter(strategy.experimental_distribute_dataset(dataset))
    ms.Checkpoint(iterator=resumed).read(path)
    assert [b.values[0].tolist() for b in resumed] == rest and len(rest) == 3


def test_batches_arrive_prepared_on_the_devices(strategy):
    n = strategy.num_replicas_in_sync
    dataset = Dataset.from_tensor_slices(
        {"x": np.arange(6 * n, dtype=np.float32), "y": np.ones(6 * n, np.int32)}
    ).batch(2 * n, drop_remainder=True)
    steps = 0
    for batch in strategy.experimental_distribute_dataset(dataset):
        for key in ("x", "y"):  # the global device array is ready before run is called
            assert batch[key]._device_array is not None
            assert batch[key]._device_array.shape == (2 * n,)
        out = strategy.run(lambda b: b["x"] * b["y"], args=(batch,))
        for rows, result in zip(batch["x"].values, strategy.experimental_local_results(out)):
            np.testing.assert_array_equal(np.asarray(result), rows)
        steps += 1
    assert steps == 3


@pytest.mark.parametrize("options, prepared", [
    (ms.InputOptions(experimental_fetch_to_device=False), False),
    (ms.InputOptions(experimental_per_replica_buffer_size=0), True),
    (ms.InputOptions(experimental_per_replica_buffer_size=3), True)])
def test_input_options_decide_where_batches_are_prepared(strategy, options, prepared):
    n = strategy.num_replicas_in_sync
    dataset = Dataset.range(5 * n).batch(n, drop_remainder=True)
    seen = []
    for batch in strategy.experimental_distribute_dataset(dataset, options):
        assert (batch._device_array is not None) == prepared
        out = strategy.run(lambda x: x + 1, args=(batch,))
        seen.append([int(v[0]) for v in strategy.experimental_local_results(out)])
    ids = strategy.extended.local_replica_ids
    assert seen == [[step * n + rid + 1 for rid in ids] for step in range(5)]
