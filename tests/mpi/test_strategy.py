"""Strategy semantics at 1-4 ranks, including the upstream documentation's examples
adapted to one replica per rank (MirroredStrategy(["GPU:0", "GPU:1"]) -> mpirun -n 2)."""

import numpy as np
import pytest

import mpistrat as ms


@pytest.fixture(params=["mirrored", "multi_worker"])
def any_strategy(request):
    if request.param == "mirrored":
        return ms.MirroredStrategy()
    return ms.MultiWorkerMirroredStrategy()


@pytest.mark.mpi(min_size=1)
def test_doc_reduce_sum_of_replica_ids(any_strategy, world):
    def step_fn():
        return ms.get_replica_context().replica_id_in_sync_group

    per_replica_result = any_strategy.run(step_fn)
    assert per_replica_result == world.rank  # a plain value: one replica per rank
    total = any_strategy.reduce("SUM", per_replica_result, axis=None)
    assert total == sum(range(world.size))  # the doc's 1 on two replicas


@pytest.mark.mpi(min_size=1)
def test_doc_run_with_constant_input(any_strategy):
    result = any_strategy.run(lambda x: x * 2.0, args=(np.float32(3.0),))
    assert result == np.float32(6.0) and result.dtype == np.float32


@pytest.mark.mpi(min_size=1)
def test_doc_run_with_distributed_values_input(any_strategy, world):
    values = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert any_strategy.run(lambda x: x * 2, args=(values,)) == 2 * world.size  # the doc's 4


@pytest.mark.mpi(min_size=1)
def test_doc_replica_context_all_reduce(any_strategy, world):
    values = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: np.int32(ctx.replica_id_in_sync_group))

    def replica_fn(value):
        return ms.get_replica_context().all_reduce("sum", value)

    result = any_strategy.run(replica_fn, args=(values,))
    assert result == sum(range(world.size)) and result.dtype == np.int32


@pytest.mark.mpi(min_size=1)
def test_doc_distribute_values_from_function(any_strategy, world):
    const = any_strategy.experimental_distribute_values_from_function(lambda ctx: 1.0)
    assert any_strategy.experimental_local_results(const) == (1.0,)
    array_value = np.arange(world.size, 0, -1, dtype=np.float64) * 1.0  # [.., 3., 2., 1.]
    by_id = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group])
    assert any_strategy.experimental_local_results(by_id) == (array_value[world.rank],)
    assert by_id.replica_ids == (world.rank,)
    counts = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert any_strategy.experimental_local_results(counts) == (world.size,)
    assert repr(counts) == f"PerReplica:{{\n  {world.rank}: {world.size}\n}}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis,shape", [(0, (4, 2, 3)), (1, (1, 8, 3)), (2, (1, 2, 12))])
def test_doc_gather_along_each_axis(any_strategy, world, axis, shape):
    single = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
    values = any_strategy.experimental_distribute_values_from_function(lambda _: single)
    out = any_strategy.gather(values, axis=axis)
    scaled = list(shape)
    scaled[axis] = scaled[axis] // 4 * world.size  # the doc uses 4 replicas
    assert out.shape == tuple(scaled) and out.dtype == np.int32
    np.testing.assert_array_equal(out, np.concatenate([single] * world.size, axis=axis))


@pytest.mark.mpi(min_size=1)
def test_doc_gather_of_two_rows(any_strategy, world):
    values = any_strategy.experimental_distribute_values_from_function(
        lambda _: np.array([[1], [2]], dtype=np.int32))
    assert any_strategy.gather(values, axis=0).ravel().tolist() == [1, 2] * world.size


@pytest.mark.mpi(min_size=1)
def test_gather_with_uneven_batches_in_replica_order(any_strategy, world):
    # a short final batch of 6 rows split as TensorFlow does over the replicas
    rows = [len(part) for part in np.array_split(np.arange(6), world.size)]
    start = sum(rows[:world.rank])
    mine = np.arange(start, start + rows[world.rank], dtype=np.float32)[:, None]
    out = any_strategy.gather(mine, axis=0)
    assert out.ravel().tolist() == list(range(6))


@pytest.mark.mpi(min_size=1)
def test_reduce_along_axis_uses_the_true_row_count(any_strategy, world):
    # Doc: a last batch of 6 split unevenly; MEAN with axis=0 divides by 6.
    per_replica = np.array_split(np.arange(6, dtype=np.float64), world.size)[world.rank]
    assert any_strategy.reduce("SUM", per_replica, axis=0) == 15.0
    assert any_strategy.reduce("MEAN", per_replica, axis=0) == 2.5
    assert any_strategy.reduce("MAX", per_replica, axis=0) == 5.0
    assert any_strategy.reduce("MIN", per_replica, axis=0) == 0.0
    batch = np.arange(8, dtype=np.float64).reshape(4, 2) + 100 * world.rank
    want = np.concatenate([np.arange(8.0).reshape(4, 2) + 100 * k for k in range(world.size)])
    np.testing.assert_allclose(any_strategy.reduce("MEAN", batch, axis=0), want.mean(axis=0))
    np.testing.assert_allclose(any_strategy.reduce("SUM", batch, axis=1),
                               want.sum(axis=1).reshape(world.size, 4).sum(axis=0))


@pytest.mark.mpi(min_size=1)
def test_reduce_elementwise_mean_counts_every_replica(any_strategy, world):
    value = np.array([world.rank, 1.0])
    np.testing.assert_allclose(any_strategy.reduce("MEAN", value, axis=None),
                               [sum(range(world.size)) / world.size, 1.0])
    assert any_strategy.reduce(ms.ReduceOp.SUM, 1.0, axis=None) == float(world.size)


@pytest.mark.mpi(min_size=1)
def test_reduce_errors(any_strategy, world):
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        any_strategy.reduce("SUM", np.ones((2, 2)), axis=2)
    with pytest.raises(RuntimeError, match="cross-replica"):
        any_strategy.run(lambda: any_strategy.reduce("SUM", 1.0, axis=None))
    with pytest.raises(ValueError, match="scalar"):
        any_strategy.gather(np.float64(1.0), axis=0)


@pytest.mark.mpi(min_size=2)
def test_reduce_axis_out_of_range_on_one_rank_raises_everywhere(any_strategy, world):
    value = np.ones((2, 2)) if world.rank == 0 else np.ones((2, 2, 2))
    with pytest.raises(ValueError, match="axis out of range"):
        any_strategy.reduce("SUM", value, axis=2)


@pytest.mark.mpi(min_size=1)
def test_reduce_of_nested_structures_and_empty_batch(any_strategy, world):
    rows = 0 if world.rank == world.size - 1 and world.size > 1 else 2
    value = {"loss": np.full(rows, 1.0), "count": np.array([rows])}
    out = any_strategy.reduce("SUM", value, axis=0)
    total = 2 * (world.size - 1 if world.size > 1 else 1)
    assert out == {"loss": float(total), "count": total}
    assert any_strategy.reduce("MAX", np.zeros((rows, 3)) + world.rank, axis=0).shape == (3,)


@pytest.mark.mpi(min_size=1)
def test_replica_context_inside_run(any_strategy, world):
    def fn(x):
        ctx = ms.get_replica_context()
        assert ctx.num_replicas_in_sync == world.size
        assert ctx.replica_id_in_sync_group == world.rank
        assert ms.get_strategy() is any_strategy and not ms.in_cross_replica_context()
        summed = ctx.all_reduce("SUM", {"a": x, "b": [x * 2, np.ones(3)]})
        mean = ctx.all_reduce(ms.ReduceOp.MEAN, x)
        gathered = ctx.all_gather({"v": np.full((world.rank + 1, 2), world.rank)}, axis=0)
        merged = ctx.merge_call(lambda s, v: s.reduce("MAX", v, axis=None), args=(x,))
        return summed, mean, gathered, merged

    summed, mean, gathered, merged = any_strategy.run(fn, args=(float(world.rank),))
    n, s = world.size, sum(range(world.size))
    assert summed["a"] == s and summed["b"][0] == 2 * s and summed["b"][1].tolist() == [n] * 3
    assert mean == s / n and merged == n - 1
    assert gathered["v"][:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)]


@pytest.mark.mpi(min_size=1)
def test_extended_and_cluster_facts(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == world.size
    from mpistrat.runtime.gpus import bound_device
    assert strategy.extended.worker_devices == (
        f"/job:worker/replica:0/task:{world.rank}/device:{bound_device().name}",)
    assert strategy.extended.should_checkpoint == (world.rank == 0)
    spec = strategy.cluster_resolver.cluster_spec()
    assert spec.num_tasks("worker") == world.size
    assert strategy.cluster_resolver.task_id == world.rank
    ms.config.experimental_connect_to_cluster(strategy.cluster_resolver)
    assert isinstance(ms.experimental.MultiWorkerMirroredStrategy(), ms.Strategy)
