"""Strategy semantics at 1-4 ranks, including the upstream documentation's examples
adapted to one replica per rank (MirroredStrategy(["GPU:0", "GPU:1"]) -> mpirun -n 2).
Array values are of the run's kind (``arrays``, MPISTRAT_TEST_ARRAYS)."""

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
def test_doc_run_with_constant_input(any_strategy, arrays):
    result = any_strategy.run(lambda x: x * 2.0, args=(arrays.asarray(3.0, np.float32),))
    arrays.assert_equal(result, np.float32(6.0), np.float32)


@pytest.mark.mpi(min_size=1)
def test_doc_run_with_distributed_values_input(any_strategy, world):
    values = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert any_strategy.run(lambda x: x * 2, args=(values,)) == 2 * world.size  # the doc's 4


@pytest.mark.mpi(min_size=1)
def test_doc_replica_context_all_reduce(any_strategy, world, arrays):
    values = any_strategy.experimental_distribute_values_from_function(
        lambda ctx: arrays.asarray(ctx.replica_id_in_sync_group, np.int32))

    def replica_fn(value):
        return ms.get_replica_context().all_reduce("sum", value)

    result = any_strategy.run(replica_fn, args=(values,))
    arrays.assert_equal(result, sum(range(world.size)), np.int32)


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
def test_doc_gather_along_each_axis(any_strategy, world, axis, shape, arrays):
    single = arrays.xp.arange(6, dtype=np.int32).reshape(1, 2, 3)
    values = any_strategy.experimental_distribute_values_from_function(lambda _: single)
    out = any_strategy.gather(values, axis=axis)
    scaled = list(shape)
    scaled[axis] = scaled[axis] // 4 * world.size  # the doc uses 4 replicas
    assert out.shape == tuple(scaled)
    arrays.assert_equal(out, arrays.xp.concatenate([single] * world.size, axis=axis), np.int32)


@pytest.mark.mpi(min_size=1)
def test_doc_gather_of_two_rows(any_strategy, world, arrays):
    values = any_strategy.experimental_distribute_values_from_function(
        lambda _: arrays.asarray([[1], [2]], np.int32))
    arrays.assert_equal(any_strategy.gather(values, axis=0).ravel(), [1, 2] * world.size)


@pytest.mark.mpi(min_size=1)
def test_gather_with_uneven_batches_in_replica_order(any_strategy, world, arrays):
    # a short final batch of 6 rows split as TensorFlow does over the replicas
    rows = [len(part) for part in np.array_split(np.arange(6), world.size)]
    start = sum(rows[:world.rank])
    mine = arrays.xp.arange(start, start + rows[world.rank], dtype=np.float32)[:, None]
    out = any_strategy.gather(mine, axis=0)
    arrays.assert_equal(out.ravel(), list(range(6)), np.float32)


@pytest.mark.mpi(min_size=1)
def test_reduce_along_axis_uses_the_true_row_count(any_strategy, world, arrays):
    # Doc: a last batch of 6 split unevenly; MEAN with axis=0 divides by 6.
    per_replica = arrays.asarray(np.array_split(np.arange(6, dtype=np.float64),
                                                world.size)[world.rank])
    batch = arrays.asarray(np.arange(8, dtype=np.float64).reshape(4, 2) + 100 * world.rank)
    want = np.concatenate([np.arange(8.0).reshape(4, 2) + 100 * k for k in range(world.size)])
    results = {op: any_strategy.reduce(op, per_replica, axis=0) for op in ("SUM", "MEAN",
                                                                          "MAX", "MIN")}
    assert [float(arrays.numpy(results[op])) for op in ("SUM", "MEAN", "MAX", "MIN")] == \
        [15.0, 2.5, 5.0, 0.0]
    mean = any_strategy.reduce("MEAN", batch, axis=0)
    np.testing.assert_allclose(arrays.numpy(mean), want.mean(axis=0))
    by_rows = any_strategy.reduce("SUM", batch, axis=1)
    np.testing.assert_allclose(arrays.numpy(by_rows),
                               want.sum(axis=1).reshape(world.size, 4).sum(axis=0))
    arrays.assert_kind([mean, by_rows, *results.values()])


@pytest.mark.mpi(min_size=1)
def test_reduce_elementwise_mean_counts_every_replica(any_strategy, world, arrays):
    value = arrays.asarray([world.rank, 1.0])
    arrays.assert_close(any_strategy.reduce("MEAN", value, axis=None),
                        [sum(range(world.size)) / world.size, 1.0])
    assert any_strategy.reduce(ms.ReduceOp.SUM, 1.0, axis=None) == float(world.size)


@pytest.mark.mpi(min_size=1)
def test_reduce_errors(any_strategy, world, arrays):
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        any_strategy.reduce("SUM", arrays.xp.ones((2, 2)), axis=2)
    with pytest.raises(RuntimeError, match="cross-replica"):
        any_strategy.run(lambda: any_strategy.reduce("SUM", 1.0, axis=None))
    with pytest.raises(ValueError, match="scalar"):
        any_strategy.gather(arrays.asarray(1.0), axis=0)


@pytest.mark.mpi(min_size=2)
def test_reduce_axis_out_of_range_on_one_rank_raises_everywhere(any_strategy, world, arrays):
    value = arrays.xp.ones((2, 2)) if world.rank == 0 else arrays.xp.ones((2, 2, 2))
    with pytest.raises(ValueError, match="axis out of range"):
        any_strategy.reduce("SUM", value, axis=2)


@pytest.mark.mpi(min_size=1)
def test_reduce_of_nested_structures_and_empty_batch(any_strategy, world, arrays):
    rows = 0 if world.rank == world.size - 1 and world.size > 1 else 2
    value = arrays.tree({"loss": np.full(rows, 1.0), "count": np.array([rows])})
    out = any_strategy.reduce("SUM", value, axis=0)
    total = 2 * (world.size - 1 if world.size > 1 else 1)
    assert {k: float(arrays.numpy(v)) for k, v in out.items()} == {"loss": total, "count": total}
    most = any_strategy.reduce("MAX", arrays.xp.zeros((rows, 3)) + world.rank, axis=0)
    assert most.shape == (3,)
    arrays.assert_kind([most, out])


@pytest.mark.mpi(min_size=1)
def test_replica_context_inside_run(any_strategy, world, arrays):
    xp = arrays.xp

    def fn(x):
        ctx = ms.get_replica_context()
        assert ctx.num_replicas_in_sync == world.size
        assert ctx.replica_id_in_sync_group == world.rank
        assert ms.get_strategy() is any_strategy and not ms.in_cross_replica_context()
        summed = ctx.all_reduce("SUM", {"a": x, "b": [x * 2, xp.ones(3)]})
        mean = ctx.all_reduce(ms.ReduceOp.MEAN, x)
        gathered = ctx.all_gather({"v": xp.full((world.rank + 1, 2), world.rank)}, axis=0)
        merged = ctx.merge_call(lambda s, v: s.reduce("MAX", v, axis=None), args=(x,))
        return summed, mean, gathered, merged

    mine = arrays.asarray(world.rank, np.float64)
    summed, mean, gathered, merged = any_strategy.run(fn, args=(mine,))
    n, s = world.size, sum(range(world.size))
    arrays.assert_equal(summed["a"], s)
    arrays.assert_equal(summed["b"][0], 2 * s)
    arrays.assert_equal(summed["b"][1], [n] * 3)
    arrays.assert_equal(mean, s / n)
    arrays.assert_equal(merged, n - 1)
    arrays.assert_equal(gathered["v"][:, 0], [k for k in range(n) for _ in range(k + 1)])


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
    if world.num_nodes > 1:
        return                              # (MirroredStrategy spans one node)
    mirrored = ms.MirroredStrategy()        # (one node: the tutorials' chief check works)
    assert mirrored.cluster_resolver.task_id == world.rank
    assert mirrored.cluster_resolver.task_type == "worker"
    assert mirrored.cluster_resolver.cluster_spec().num_tasks("worker") == world.size
