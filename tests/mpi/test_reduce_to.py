"""StrategyExtended.reduce_to and batch_reduce_to at 1-4 ranks, as in TensorFlow, with values
of the run's array kind (``arrays``, MPISTRAT_TEST_ARRAYS)."""

import numpy as np
import pytest

import mpistrat as ms


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX"])
def test_reduce_to_combines_per_replica_values(strategy, world, op, arrays):
    r, n, xp = world.rank, world.size, arrays.xp
    value = ms.PerReplica((xp.arange(4, dtype=xp.float32) * (r + 1),), replica_ids=(r,))
    out = strategy.extended.reduce_to(op, value, destinations="/job:worker/cpu:0")
    every = xp.stack([xp.arange(4, dtype=xp.float32) * (k + 1) for k in range(n)])
    want = {"SUM": every.sum(0), "MEAN": every.sum(0) / n, "MIN": every.min(0),
            "MAX": every.max(0)}[op]
    arrays.assert_close(out, want, rtol=1e-6, dtype=np.float32)


@pytest.mark.mpi(min_size=1)
def test_reduce_to_plain_value_is_this_ranks_replica_and_scalar_stays_scalar(strategy, world):
    out = strategy.extended.reduce_to(ms.ReduceOp.SUM, 1.0, destinations=ms.Variable(0.0))
    assert np.ndim(out) == 0 and float(out) == world.size


@pytest.mark.mpi(min_size=1)
def test_reduce_to_with_the_value_as_destinations_is_an_all_reduce(strategy, world, arrays):
    xp = arrays.xp
    value = ms.PerReplica((xp.full((2, 3), world.rank, dtype=xp.int64),), replica_ids=(world.rank,))
    out = strategy.extended.reduce_to("sum", value, destinations=value)
    arrays.assert_equal(out, xp.full((2, 3), sum(range(world.size))), np.int64)


@pytest.mark.mpi(min_size=1)
def test_batch_reduce_to_gives_one_result_per_pair_in_one_engine_call(strategy, world, arrays):
    r, n, xp = world.rank, world.size, arrays.xp
    values = [xp.full(3 + i, float(r + i), dtype=xp.float32) for i in range(20)]
    values.append(xp.full(5, r, dtype=xp.int32))
    values.append(ms.PerReplica((arrays.asarray(r, np.float64),), replica_ids=(r,)))
    pairs = [(v, "/cpu:0") for v in values]
    engine = strategy.extended.engine
    before = engine._calls
    out = strategy.extended.batch_reduce_to("MEAN", pairs)
    assert engine._calls - before == 1
    assert isinstance(out, list) and len(out) == len(pairs)
    ranks = sum(range(n))
    for i in range(20):
        arrays.assert_close(out[i], np.full(3 + i, (ranks + n * i) / n), 1e-6, np.float32)
    arrays.assert_equal(out[20], np.full(5, ranks // n), np.int32)  # integers truncate
    assert np.ndim(out[21]) == 0
    arrays.assert_close(out[21], ranks / n)


@pytest.mark.mpi(min_size=1)
def test_batch_reduce_to_fuses_small_tensors_into_one_collective(strategy, world):
    """Counted with the collective timeline: one bucket, so one MPI all-reduce."""
    from mpistrat.runtime import timeline
    values = [np.full(64, float(world.rank), dtype=np.float32) for _ in range(50)]
    with timeline.recording() as events:
        out = strategy.extended.batch_reduce_to("SUM", [(v, "/cpu:0") for v in values])
    buckets = [e for e in events if e.category == "bucket"]
    assert len(buckets) == 1 and buckets[0].nbytes == 50 * 64 * 4
    np.testing.assert_array_equal(out[7], np.full(64, float(sum(range(world.size)))))


@pytest.mark.mpi(min_size=1)
def test_bad_pairs_and_empty_destinations_raise(strategy):
    with pytest.raises(ValueError, match="destinations can not be empty"):
        strategy.extended.reduce_to("SUM", 1.0, destinations=None)
    with pytest.raises(ValueError, match="destinations can not be empty"):
        strategy.extended.batch_reduce_to("SUM", [(1.0, "")])
    with pytest.raises(ValueError, match="pairs"):
        strategy.extended.batch_reduce_to("SUM", [1.0, 2.0])
    with pytest.raises(TypeError, match="destinations must be"):
        strategy.extended.reduce_to("SUM", 1.0, destinations={"a": 1})
    with pytest.raises(ValueError, match="unknown reduce op"):
        strategy.extended.reduce_to("PROD", 1.0, destinations="/cpu:0")
    assert strategy.extended.batch_reduce_to("SUM", []) == []


@pytest.mark.mpi(min_size=1)
def test_reduce_to_in_replica_context_raises(strategy):
    def step():
        return strategy.extended.reduce_to("SUM", 1.0, destinations="/cpu:0")
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(step)
