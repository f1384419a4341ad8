"""Cached steps and their outputs: a rank that changes shapes after a step was
cached makes every rank raise (no variable written); outputs stay on the devices
until read and feed the next step as they are."""

import numpy as np
import pytest

import mpistrat as ms


@pytest.mark.mpi(min_size=2)
def test_cached_local_step_with_other_shapes_on_one_rank_raises_everywhere(strategy, world):
    with strategy.scope():
        w = ms.Variable(np.zeros(3, np.float32))

    def step(x):
        w.assign(w.read_value() + x.sum())
        return x * 2

    same = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2, np.float32))
    for _ in range(2):  # traced, then cached
        out = strategy.run(step, args=(same,))
    assert float(np.asarray(strategy.experimental_local_results(out)[0])[0]) == 2.0
    before = np.asarray(strategy.experimental_local_results(w)[0]).copy()
    other = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2 + (world.rank == 1), np.float32))
    with pytest.raises(ValueError, match=r"rank 1 has .*\[3\]"):
        strategy.run(step, args=(other if world.rank == 1 else same,))
    after = np.asarray(strategy.experimental_local_results(w)[0])
    np.testing.assert_array_equal(before, after)
    out = strategy.run(step, args=(same,))  # and the strategy still works
    assert float(np.asarray(strategy.experimental_local_results(out)[0])[0]) == 2.0


def test_outputs_split_on_demand_and_feed_the_next_step_without_copies(strategy, world):
    from mpistrat.distribute.tpu_run import DevicePerReplica
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group, np.float32))
    y = strategy.run(lambda v: v + 1, args=(x,))
    assert isinstance(y, DevicePerReplica) and y._split is None
    z = strategy.run(lambda v: v * 10, args=(y,))          # fed back as the device array
    assert y._split is None
    ids = strategy.extended.local_replica_ids
    for rid, part in zip(ids, strategy.experimental_local_results(z)):
        np.testing.assert_array_equal(np.asarray(part), np.full((2, 3), (rid + 1) * 10))
    s = strategy.run(lambda v: v.sum(), args=(z,))          # scalar outputs
    assert [float(v) for v in strategy.experimental_local_results(s)] == \
        [60.0 * (rid + 1) for rid in ids]
    again = strategy.run(lambda v: v + 0.5, args=(s,))
    assert [float(v) for v in again.values] == [60.0 * (rid + 1) + 0.5 for rid in ids]
    total = strategy.reduce("SUM", s, axis=None)
    assert float(total) == sum(60.0 * (r + 1) for r in range(strategy.num_replicas_in_sync))
