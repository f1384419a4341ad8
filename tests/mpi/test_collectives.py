"""The collective engine at 1-4 ranks: fusion, algorithms, validation, deadlines.

Values are of the run's array kind (``arrays``, MPISTRAT_TEST_ARRAYS) except in the tests
that compare raw MPI buffers."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine
from mpistrat.collectives.algorithms import allreduce


def engine_for(world, **options):
    return CollectiveEngine(world.comm, ms.CommunicationOptions(**options))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX"])
def test_all_reduce_nested_structure_matches_numpy(world, op, arrays):
    engine = engine_for(world)
    r, n = world.rank, world.size
    value = arrays.tree({"w": np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1),
                         "b": [np.array([r, -r], dtype=np.int64), np.float64(r + 0.5)]})
    out = engine.all_reduce(value, op)
    arrays.assert_kind(out)
    every = [{"w": np.arange(6, dtype=np.float32).reshape(2, 3) * (k + 1),
              "b": [np.array([k, -k]), k + 0.5]} for k in range(n)]
    combine = {"SUM": np.sum, "MEAN": np.sum, "MIN": np.min, "MAX": np.max}[op]
    want_w = combine([e["w"] for e in every], axis=0)
    want_i = combine([e["b"][0] for e in every], axis=0)
    want_f = combine([e["b"][1] for e in every], axis=0)
    if op == "MEAN":
        want_w, want_f = want_w / n, want_f / n
        want_i = np.trunc(want_i / n).astype(np.int64)  # integers truncate, as TF's Div
    arrays.assert_close(out["w"], want_w, rtol=1e-6, dtype=np.float32)
    arrays.assert_equal(out["b"][0], want_i, dtype=np.int64)
    arrays.assert_close(out["b"][1], want_f)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pack", [64, 1 << 20])
def test_many_small_tensors_fused_or_not_give_the_same_sums(world, pack, arrays):
    engine = engine_for(world, bytes_per_pack=pack)
    xp = arrays.xp
    tensors = [xp.full(7 + i % 5, float(world.rank + i), dtype=xp.float32) for i in range(50)]
    out = engine.all_reduce(tensors, "SUM")
    ranks = sum(range(world.size))
    for i, result in enumerate(out):
        arrays.assert_equal(result, xp.full(7 + i % 5, ranks + world.size * i), np.float32)
    assert arrays.numpy(tensors[0])[0] == world.rank  # inputs are never modified


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("compares our own algorithms in place and out of place")
@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner"])
@pytest.mark.parametrize("op", [ms.ReduceOp.MIN, ms.ReduceOp.MAX])
def test_in_place_and_out_of_place_give_the_same_bits(world, algorithm, op):
    """Signed zeros and NaN payloads: MIN/MAX of -0.0 and 0.0 depend on the operand order,
    so the out-of-place combine (received straight into the result) keeps the order of the
    in-place one (received into scratch)."""
    values = np.array([0.0, -0.0, np.nan, 1.0, -0.0, 0.0] * 167, np.float64)
    send = np.roll(values, world.rank) * (1 if world.rank % 2 else -1)
    out = np.empty_like(send)
    allreduce(world.comm, send, out, op, None, algorithm)
    in_place = send.copy()
    allreduce(world.comm, in_place, in_place, op, None, algorithm)
    assert out.tobytes() == in_place.tobytes()


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("compares the ring with MPI's Allreduce on host buffers")
@pytest.mark.parametrize("count", [0, 1, 3, 1001, 300_001])
@pytest.mark.parametrize("op", [ms.ReduceOp.SUM, ms.ReduceOp.MIN, ms.ReduceOp.MAX])
def test_ring_algorithm_equals_mpi_allreduce(world, count, op):
    rng = np.random.default_rng(world.rank)
    send = rng.integers(-1000, 1000, size=count).astype(np.float64)
    by_ring, by_mpi = np.empty_like(send), np.empty_like(send)
    allreduce(world.comm, send, by_ring, op, None, "ring")
    allreduce(world.comm, send, by_mpi, op, None, "mpi")
    np.testing.assert_array_equal(by_ring, by_mpi)
    in_place = send.copy()
    allreduce(world.comm, in_place, in_place, op, ms.collectives.algorithms.Deadline.after(60),
              "ring")
    np.testing.assert_array_equal(in_place, by_mpi)


@pytest.mark.mpi(min_size=1)
def test_large_tensor_goes_through_the_ring_and_half_precision_and_bool(world, arrays):
    engine = engine_for(world)
    xp = arrays.xp
    big = xp.full((1024, 1024), world.rank + 1, dtype=xp.float32)  # 4 MiB: the ring
    out = engine.all_reduce([big, arrays.asarray(1.5, np.float16),
                             arrays.asarray([world.rank == 0, True])], "MAX")
    arrays.assert_equal(out[0], xp.full((1024, 1024), world.size, dtype=xp.float32))
    arrays.assert_equal(out[1], np.float16(1.5), np.float16)
    arrays.assert_equal(out[2], [True, True], np.bool_)
    with pytest.raises(TypeError, match="bool"):
        engine.all_reduce(arrays.asarray([True]), "SUM")


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_raise_on_every_rank_naming_the_ranks(world, arrays):
    engine = engine_for(world)
    xp = arrays.xp
    shape = (3,) if world.rank != 1 else (4,)
    with pytest.raises(ms.errors.InvalidArgumentError) as info:
        engine.all_reduce([xp.ones(2), xp.ones(shape)], "SUM")
    text = str(info.value)
    assert "tensor 1" in text
    # The engine is still usable afterwards.
    arrays.assert_equal(engine.all_reduce(xp.ones(1), "SUM"), [world.size])
    assert "rank 1 has float64[4]" in text and "float64[3]" in text


@pytest.mark.mpi(min_size=2)
def test_mismatched_dtype_and_different_collectives_are_named(world, arrays):
    engine = engine_for(world)
    dtype = np.float32 if world.rank == 0 else np.float64
    with pytest.raises(ValueError, match="rank 0 has") as info:
        engine.all_reduce(arrays.xp.ones(2, dtype=dtype), "SUM")
    with pytest.raises(ValueError, match="different collectives"):
        engine.all_reduce(arrays.xp.ones(2), "SUM" if world.rank == 0 else "MAX")
    assert "rank 0 has float32" in str(info.value)


@pytest.mark.mpi(min_size=1)
def test_all_gather_uneven_rows_in_rank_order(world, arrays):
    engine = engine_for(world)
    r, xp = world.rank, arrays.xp
    mine = xp.arange(r + 1, dtype=xp.int32)[:, None] + 10 * r * xp.ones((1, 2), xp.int32)
    out = engine.all_gather({"x": mine, "z": xp.full((r, 0), r, xp.float64)}, axis=0)
    assert out["z"].shape == (sum(range(world.size)), 0)
    want = xp.concatenate([xp.arange(k + 1)[:, None] + 10 * k * xp.ones((1, 2)) for k in
                           range(world.size)])
    arrays.assert_equal(out["x"], want, np.int32)
    arrays.assert_kind(out["z"])
    y = engine.all_gather(xp.full((2, r), r, xp.float64), axis=1)
    assert y.shape == (2, sum(range(world.size)))
    arrays.assert_equal(y[0], np.concatenate([[k] * k for k in range(world.size)]))


@pytest.mark.mpi(min_size=2)
def test_all_gather_rejects_other_dimension_mismatches_and_scalars(world, arrays):
    engine = engine_for(world)
    xp = arrays.xp
    with pytest.raises(ValueError, match="rank 1 has") as info:
        engine.all_gather(xp.ones((1, 2 if world.rank != 1 else 3)), axis=0)
    with pytest.raises(ValueError, match="scalar"):
        engine.all_gather(arrays.asarray(1.0), axis=0)
    with pytest.raises(ValueError, match="out of range"):
        engine.all_gather(xp.ones(2), axis=1)
    assert "rank 1 has float64[?,3]" in str(info.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.numpy_only("the kind plays no part in agreeing on a timeout")
def test_ranks_that_disagree_on_the_timeout_get_a_clear_error(world, monkeypatch):
    monkeypatch.delenv("MPISTRAT_COLLECTIVE_TIMEOUT", raising=False)
    engine = engine_for(world, timeout_seconds=30.0 if world.rank == 0 else None)
    with pytest.raises(ValueError, match="only rank 0 set a collective timeout"):
        engine.all_reduce(np.ones(2), "SUM")


@pytest.mark.mpi(min_size=1)
def test_broadcast_gives_everyone_root_values(world, arrays):
    engine = engine_for(world)
    value = arrays.tree({"a": np.full(3, world.rank), "b": [np.float32(world.rank)]})
    out = engine.broadcast(value, root=world.size - 1)
    arrays.assert_equal(out["a"], [world.size - 1] * 3)
    arrays.assert_equal(out["b"][0], world.size - 1, np.float32)


@pytest.mark.mpi(min_size=2)
@pytest.mark.numpy_only("joins the validation probe by hand, with raw MPI requests")
@pytest.mark.parametrize("value", [1.0, np.ones(4), np.ones(11)],
                         ids=["a loss in the probe", "a small array in the probe", "the long path"])
def test_late_rank_makes_the_waiting_rank_time_out_then_engine_refuses(world, value):
    """A timed engine's probe (which carries a loss or a small array, or validates the long
    path) gives up on a rank that does not come, names the rank and refuses what follows."""
    comm = world.new_comm("timeout-test")
    engine = CollectiveEngine(comm, ms.CommunicationOptions(timeout_seconds=0.3))
    if world.rank == 0:
        start = time.monotonic()
        with pytest.raises(ms.errors.DeadlineExceededError, match="rank 0.*validation|"
                           "validation.*rank 0") as info:
            engine.all_reduce(value, "SUM")
        assert time.monotonic() - start < 5
        with pytest.raises(ms.errors.AbortedError, match="timed out"):
            engine.all_reduce(np.ones(4), "SUM")
        MPI.Request.Waitall(info.value.pending_requests)  # the late rank joins it now
    else:
        time.sleep(1.5)
        # Join only the step rank 0 gave up in: the validation probe.
        from mpistrat.collectives.deadline import Deadline
        from mpistrat.collectives.validation import agree
        shape = np.shape(value)
        agree(comm, "all_reduce SUM", ((np.dtype(np.float64).str, shape),), Deadline.after(60),
              engine.path_of(value, "SUM"))
    comm.Barrier()
    comm.Free()
