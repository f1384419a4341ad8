"""TPUStrategy through the JAX bridge: initialisation, run, reduce, gather, values.

The upstream page's examples (tf.distribute.experimental.TPUStrategy), adapted:
every JAX device of every rank is one replica."""

import numpy as np
import pytest

import mpistrat as ms
from conftest import DEVICES_PER_HOST

pytestmark = pytest.mark.mpi(min_size=1)


def test_upstream_initialisation_gives_a_replica_per_device(strategy, world):
    topology = ms.tpu.experimental.initialize_tpu_system()  # idempotent
    assert (topology.num_tasks, topology.num_devices_per_task) == (world.size, DEVICES_PER_HOST)
    assert strategy.num_replicas_in_sync == world.size * DEVICES_PER_HOST
    first = world.rank * DEVICES_PER_HOST
    assert strategy.extended.local_replica_ids == tuple(range(first, first + DEVICES_PER_HOST))
    assert strategy.extended.worker_devices[1] == \
        f"/job:worker/replica:0/task:{world.rank}/device:CPU:1"
    resolver = strategy.cluster_resolver
    assert resolver.num_accelerators() == {"CPU": DEVICES_PER_HOST}
    assert resolver.cluster_spec().num_tasks("worker") == world.size
    assert resolver.task_id == world.rank
    assert ms.experimental.TPUStrategy is ms.TPUStrategy


def test_unsupported_parts_say_so(strategy):
    with pytest.raises(ValueError, match="finds its hosts from MPI"):
        ms.cluster_resolver.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")
    with pytest.raises(NotImplementedError, match="device_assignment"):
        ms.TPUStrategy(device_assignment=object())
    with pytest.raises(NotImplementedError, match="logical-device"):
        strategy.experimental_split_to_logical_devices(np.zeros(4), [2])
    with pytest.raises(NotImplementedError, match="one-axis mesh"):
        ms.tpu.experimental.DeviceAssignment.build(None)


def test_reduce_of_replica_ids(strategy):
    n = strategy.num_replicas_in_sync

    def step_fn():
        i = ms.get_replica_context().replica_id_in_sync_group
        return i

    per_replica = strategy.run(step_fn)
    assert isinstance(per_replica, ms.PerReplica)
    assert per_replica.replica_ids == strategy.extended.local_replica_ids
    local = strategy.experimental_local_results(per_replica)
    assert [int(x) for x in local] == list(strategy.extended.local_replica_ids)
    assert int(strategy.reduce("SUM", per_replica, axis=None)) == n * (n - 1) // 2
    assert int(strategy.reduce("MAX", per_replica, axis=None)) == n - 1
    assert int(strategy.reduce("MEAN", per_replica, axis=None)) == (n - 1) // 2  # int: truncates


def test_values_from_function_examples(strategy):
    n = strategy.num_replicas_in_sync
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    assert strategy.experimental_local_results(ones) == (1.0,) * DEVICES_PER_HOST
    array_value = np.arange(n, 0, -1, dtype=np.float32)        # [n, ..., 1]
    by_id = strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group])
    ids = strategy.extended.local_replica_ids
    assert strategy.experimental_local_results(by_id) == tuple(array_value[i] for i in ids)
    counts = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert strategy.experimental_local_results(counts) == (n,) * DEVICES_PER_HOST
    # the values run on every replica: doubled, then summed over all replicas
    doubled = strategy.run(lambda x: x * 2, args=(by_id,))
    assert float(strategy.reduce("SUM", doubled, axis=None)) == pytest.approx(n * (n + 1))


def test_gather_examples(strategy):
    n = strategy.num_replicas_in_sync
    values = strategy.experimental_distribute_values_from_function(
        lambda _: np.array([[1], [2]], dtype=np.int32))
    gathered = strategy.gather(values, axis=0)
    np.testing.assert_array_equal(gathered, np.tile([[1], [2]], (n, 1)))
    single = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
    values = strategy.experimental_distribute_values_from_function(lambda _: single)
    for axis in range(3):
        np.testing.assert_array_equal(strategy.gather(values, axis=axis),
                                      np.concatenate([single] * n, axis=axis))


def test_gather_is_in_replica_order(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group] * 2))
    np.testing.assert_array_equal(strategy.gather(values, axis=0),
                                  np.repeat(np.arange(strategy.num_replicas_in_sync), 2))


def test_gather_of_uneven_shapes_is_rejected(strategy, world):
    uneven = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros(1 + ctx.replica_id_in_sync_group % 2))
    with pytest.raises(ValueError, match="identical shapes"):
        strategy.gather(uneven, axis=0)


@pytest.mark.mpi(min_size=2)
def test_gather_of_uneven_shapes_across_hosts_names_the_ranks(strategy, world):
    uneven = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros(1 + world.rank))
    with pytest.raises(ValueError, match=r"identical shapes.*rank 0 has float64\[1\]"):
        strategy.gather(uneven, axis=0)


def test_all_reduce_and_all_gather_cross_hosts(strategy):
    n = strategy.num_replicas_in_sync
    ids = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group], dtype=np.float32))

    def step(x):
        ctx = ms.get_replica_context()
        return {"sum": ctx.all_reduce("SUM", x), "mean": ctx.all_reduce("MEAN", x),
                "min": ctx.all_reduce(ms.ReduceOp.MIN, x), "max": ctx.all_reduce("max", x),
                "rows": ctx.all_gather(x, axis=0),
                "cols": ctx.all_gather(x.reshape(1, 1) + 0 * x, axis=1)}

    out = strategy.run(step, args=(ids,))
    for local in strategy.experimental_local_results(out):
        assert float(local["sum"][0]) == n * (n - 1) / 2
        assert float(local["mean"][0]) == pytest.approx((n - 1) / 2)
        assert (float(local["min"][0]), float(local["max"][0])) == (0.0, n - 1)
        np.testing.assert_array_equal(np.asarray(local["rows"]), np.arange(n))
        np.testing.assert_array_equal(np.asarray(local["cols"]), np.arange(n)[None, :])


def test_all_gather_of_a_scalar_is_rejected(strategy):
    with pytest.raises(ValueError, match="scalar"):
        strategy.run(lambda: ms.get_replica_context().all_gather(1.0, axis=0))


def test_merge_call_reduces_with_xla(strategy):
    n = strategy.num_replicas_in_sync

    def step():
        ctx = ms.get_replica_context()
        value = ctx.replica_id_in_sync_group * 1.0
        return ctx.merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(value,))

    out = strategy.run(step)
    assert [float(x) for x in strategy.experimental_local_results(out)] == \
        [n * (n - 1) / 2] * DEVICES_PER_HOST


def test_reduce_along_an_axis_counts_every_row(strategy):
    n = strategy.num_replicas_in_sync
    batches = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(4, dtype=np.float64) + 4 * ctx.replica_id_in_sync_group)
    total = np.arange(4 * n, dtype=np.float64)
    assert float(strategy.reduce("SUM", batches, axis=0)) == total.sum()
    assert float(strategy.reduce("MEAN", batches, axis=0)) == pytest.approx(total.mean())
    np.testing.assert_allclose(strategy.reduce("MEAN", batches, axis=None),
                               total.reshape(n, 4).mean(axis=0))
    # a plain value is every local replica's value
    assert float(strategy.reduce("SUM", 1.0, axis=None)) == n


def test_run_caches_one_program_per_signature(strategy):
    cache = strategy.extended.steps
    calls = []

    def step(x):
        calls.append(1)       # runs once per trace
        return x + 1

    for value in (1.0, 2.0, 3.0):
        out = strategy.run(step, args=(np.float32(value),))
        assert float(strategy.experimental_local_results(out)[0]) == value + 1
    assert len(calls) == 1
    strategy.run(step, args=(np.zeros(3, np.float32),))
    assert len(calls) == 2
    assert len(cache._steps) >= 2


def test_run_rejects_components_of_different_shapes(strategy):
    uneven = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros(1 + ctx.replica_id_in_sync_group % 2))
    with pytest.raises(ValueError, match="static shapes"):
        strategy.run(lambda x: x, args=(uneven,))
    with pytest.raises(ValueError, match="list or tuple"):
        strategy.run(lambda x: x, args=np.zeros(2))
    with pytest.raises(ValueError, match=f"1 components .* runs {DEVICES_PER_HOST} replicas"):
        strategy.run(lambda x: x, args=(ms.PerReplica([np.zeros(2)], [0]),))


@pytest.mark.mpi(min_size=2)
def test_run_with_other_shapes_on_another_host_names_the_rank(strategy, world):
    uneven = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros(1 + world.rank, np.float32))
    with pytest.raises(ValueError, match=r"rank 1 has .*\[2\]"):
        strategy.run(lambda x: x * 2, args=(uneven,))
    # and the strategy still works afterwards
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", 1.0))
    assert float(strategy.experimental_local_results(out)[0]) == strategy.num_replicas_in_sync


def test_a_step_that_fails_to_trace_raises_and_the_next_works(strategy):
    def broken(x):
        raise KeyError("no such layer")

    with pytest.raises(KeyError, match="no such layer"):
        strategy.run(broken, args=(np.float32(1),))
    out = strategy.run(lambda x: x, args=(np.float32(1),))
    assert float(strategy.experimental_local_results(out)[0]) == 1.0


def test_contexts(strategy):
    with strategy.scope():
        assert ms.get_strategy() is strategy
        assert ms.in_cross_replica_context()
        seen = []
        strategy.run(lambda: seen.append(ms.get_replica_context().num_replicas_in_sync) or 0)
        assert seen == [strategy.num_replicas_in_sync]
        with pytest.raises(RuntimeError, match="cross-replica"):
            strategy.run(lambda: strategy.reduce("SUM", 1.0, axis=None))
    assert not ms.has_strategy()


@pytest.mark.mpi(min_size=2)
def test_uneven_components_on_one_rank_only_raise_everywhere(strategy, world):
    def value_fn(ctx):
        if world.rank == 1:
            return np.zeros(1 + ctx.replica_id_in_sync_group % 2, np.float32)
        return np.zeros(1, np.float32)

    values = strategy.experimental_distribute_values_from_function(value_fn)
    with pytest.raises(ValueError, match="rank 1 has uneven"):
        strategy.run(lambda x: x, args=(values,))


def test_large_per_replica_batches_that_are_views_of_one_batch_travel_without_a_copy(strategy):
    rows = (np.arange(DEVICES_PER_HOST * 4096 * 64) % 7).astype(np.float32).reshape(-1, 64)
    parts = np.split(rows, DEVICES_PER_HOST)                 # 4 MiB of views, end to end
    batch = ms.PerReplica(parts, strategy.extended.local_replica_ids)
    out = strategy.run(lambda x: x.sum(axis=0), args=(batch,))
    for part, result in zip(parts, strategy.experimental_local_results(out)):
        np.testing.assert_allclose(np.asarray(result), part.sum(axis=0), rtol=1e-6)
    shuffled = ms.PerReplica(parts[::-1], strategy.extended.local_replica_ids)  # not in order
    out = strategy.run(lambda x: x[0, 0], args=(shuffled,))
    assert [float(v) for v in strategy.experimental_local_results(out)] == \
        [float(p[0, 0]) for p in parts[::-1]]
