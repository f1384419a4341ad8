"""Variables under a strategy: initial values, aggregations, synchronizations. Initial values
and updates are of the run's array kind (``arrays``, MPISTRAT_TEST_ARRAYS) and the variable keeps
that kind; ``numpy()`` reads back NumPy, as in TensorFlow."""

import numpy as np
import pytest

import mpistrat as ms

A = ms.VariableAggregation
S = ms.VariableSynchronization


@pytest.mark.mpi(min_size=1)
def test_doc_scope_mirrored_variable_starts_from_rank_zero(strategy, world, arrays):
    with strategy.scope():
        mirrored_variable = ms.Variable(1.0)
        from_rank = ms.Variable(lambda: arrays.xp.full(2, float(world.rank)))
    assert mirrored_variable.distributed
    assert repr(mirrored_variable) == (
        f"MirroredVariable:{{\n  {world.rank}: <ms.Variable 'Variable:0' shape=() "
        f"dtype=float64, numpy=1.0>\n}}")
    assert from_rank.numpy().tolist() == [0.0, 0.0]  # rank 0's value everywhere
    regular_variable = ms.Variable(1.0)
    assert repr(regular_variable) == "<ms.Variable 'Variable:0' shape=() dtype=float64, numpy=1.0>"
    arrays.assert_kind(from_rank.read_value())   # a variable keeps its initial value's kind


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aggregation,expected", [
    (A.SUM, lambda n, s: 10 + s), (A.MEAN, lambda n, s: 10 + s / n),
    (A.ONLY_FIRST_REPLICA, lambda n, s: 10.0), (A.NONE, None)])
def test_assign_add_in_replica_context_follows_the_aggregation(strategy, world, aggregation,
                                                               expected, arrays):
    with strategy.scope():
        v = ms.Variable(arrays.asarray([10.0]), aggregation=aggregation)
    strategy.run(lambda: v.assign_add(arrays.asarray([float(world.rank)])))
    n, s = world.size, sum(range(world.size))
    want = 10.0 + world.rank if expected is None else expected(n, s)
    assert float(v.numpy()[0]) == pytest.approx(want)
    arrays.assert_kind(v.read_value())


@pytest.mark.mpi(min_size=1)
def test_assign_in_replica_context_sum_and_first_replica(strategy, world, arrays):
    xp = arrays.xp
    with strategy.scope():
        total = ms.Variable(xp.zeros(2), aggregation=A.SUM)
        first = ms.Variable(xp.zeros(2), aggregation=A.ONLY_FIRST_REPLICA)
    strategy.run(lambda: (total.assign(xp.full(2, 1.0 + world.rank)),
                          first.assign(xp.full(2, 5.0 + world.rank))))
    assert total.numpy().tolist() == [world.size + sum(range(world.size))] * 2
    assert first.numpy().tolist() == [5.0, 5.0]


@pytest.mark.mpi(min_size=1)
def test_cross_replica_assign_applies_everywhere(strategy, world):
    with strategy.scope():
        v = ms.Variable(0.0, aggregation=A.SUM)
        v.assign(3.0)
    assert float(v) == 3.0


@pytest.mark.mpi(min_size=1)
def test_mean_on_integer_variable_raises(strategy, arrays):
    with strategy.scope():
        v = ms.Variable(arrays.asarray(1, np.int32), aggregation=A.MEAN)
    with pytest.raises(ValueError, match="MEAN cannot apply to an integer"):
        strategy.run(lambda: v.assign_add(arrays.asarray(1, np.int32)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aggregation", [A.SUM, A.MEAN, A.ONLY_FIRST_REPLICA])
def test_on_read_keeps_per_replica_values_and_reduces_on_read(strategy, world, aggregation):
    with strategy.scope():
        v = ms.Variable(0.0, synchronization=S.ON_READ, aggregation=aggregation)
    assert not v.trainable
    local = strategy.run(lambda: float(v.assign_add(world.rank + 1.0).read_value()))
    assert local == world.rank + 1.0  # replica context reads the local value
    n, s = world.size, sum(range(1, world.size + 1))
    with strategy.scope():
        read = float(v)
    assert read == pytest.approx({A.SUM: s, A.MEAN: s / n, A.ONLY_FIRST_REPLICA: 1.0}[aggregation])
    assert repr(v).startswith("SyncOnReadVariable:{")


@pytest.mark.mpi(min_size=1)
def test_on_read_cross_replica_assign_and_none_aggregation(strategy, world):
    with strategy.scope():
        counter = ms.Variable(0.0, synchronization=S.ON_READ, aggregation=A.SUM)
        counter.assign(6.0)
        assert float(counter) == pytest.approx(6.0)  # each replica holds 6 / n
        with pytest.raises(ValueError, match="use assign"):
            counter.assign_add(1.0)
        unreduced = ms.Variable(1.0, synchronization=S.ON_READ, aggregation=A.NONE)
        with pytest.raises(ValueError, match="no cross-replica value"):
            unreduced.numpy()
    assert strategy.run(lambda: float(counter)) == pytest.approx(6.0 / world.size)


# -- outside every scope: TensorFlow's cross-replica semantics (issue 16) ----------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aggregation", [A.SUM, A.MEAN, A.ONLY_FIRST_REPLICA, A.NONE])
def test_writes_outside_every_scope_are_cross_replica(strategy, world, aggregation):
    with strategy.scope():
        v = ms.Variable(10.0, aggregation=aggregation)
    assert not ms.has_strategy()
    v.assign_add(1.0)            # TensorFlow: 11 at any width, whatever the aggregation
    assert float(v.numpy()) == 11.0
    v.assign_sub(2.0)
    v.assign(v.numpy() * 2)
    assert float(v.numpy()) == 18.0
    assert world.comm.allgather(float(v.numpy())) == [18.0] * world.size


@pytest.mark.mpi(min_size=1)
def test_replica_context_writes_still_aggregate_after_outside_writes(strategy, world):
    with strategy.scope():
        v = ms.Variable(0.0, aggregation=A.SUM)
    v.assign_add(1.0)                               # cross-replica: +1
    strategy.run(lambda: v.assign_add(1.0))         # replica context: +N
    assert float(v.numpy()) == 1.0 + world.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aggregation", [A.SUM, A.MEAN, A.ONLY_FIRST_REPLICA])
def test_on_read_reads_outside_every_scope_are_the_aggregate(strategy, world, aggregation):
    with strategy.scope():
        v = ms.Variable(0.0, synchronization=S.ON_READ, aggregation=aggregation)
    strategy.run(lambda: v.assign(world.rank + 1.0))
    n, s = world.size, sum(range(1, world.size + 1))
    want = {A.SUM: s, A.MEAN: s / n, A.ONLY_FIRST_REPLICA: 1.0}[aggregation]
    assert float(v.read_value()) == pytest.approx(want)   # no scope entered
    assert float(v.numpy()) == pytest.approx(want)
    assert float(v) == pytest.approx(want)
    assert strategy.run(lambda: float(v.read_value())) == world.rank + 1.0


@pytest.mark.mpi(min_size=1)
def test_on_read_sum_cross_replica_assign_outside_reads_back(strategy, world):
    with strategy.scope():
        counter = ms.Variable(0.0, synchronization=S.ON_READ, aggregation=A.SUM)
    counter.assign(6.0)
    assert float(counter) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="use assign"):
        counter.assign_add(1.0)


@pytest.mark.mpi(min_size=1)
def test_checkpoint_made_in_scope_keeps_a_local_save_counter(strategy, world, tmp_path):
    shared_dir = world.comm.bcast(str(tmp_path), root=0)
    with strategy.scope():
        v = ms.Variable(np.arange(3.0), aggregation=A.SUM)
        ckpt = ms.Checkpoint(v=v)
    assert not ckpt.save_counter.distributed
    path = ckpt.save(f"{shared_dir}/ckpt")
    v.assign(np.zeros(3))
    ckpt.restore(path).assert_consumed()
    assert v.numpy().tolist() == [0.0, 1.0, 2.0] and int(ckpt.save_counter.numpy()) == 1
