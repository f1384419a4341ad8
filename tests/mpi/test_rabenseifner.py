"""The recursive halving-doubling all-reduce (``rabenseifner``) at 1-4 ranks.

It must equal MPI's own ``Allreduce`` for every op, dtype and size (sizes
smaller than the rank count included), in place and with a deadline, and be
reachable by name the way a user asks for an algorithm.
"""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import algorithms
from mpistrat.collectives.algorithms import allreduce
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.reduce_op import ReduceOp


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8])
def test_rabenseifner_equals_mpi_allreduce(world, op, dtype):
    rng = np.random.default_rng(world.rank)
    for count in (0, 1, 2, 3, 7, 1000, 4099, 1 << 18):
        high = 256 // world.size if dtype is np.uint8 else 50   # no overflow: exact in any order
        send = rng.integers(0, high, count).astype(dtype)
        expected = np.empty_like(send)
        world.comm.Allreduce(send, expected, op.mpi_op)
        recv = np.empty_like(send)
        allreduce(world.comm, send, recv, op, None, "rabenseifner")
        np.testing.assert_array_equal(recv, expected, err_msg=f"{op} {dtype} {count}")


def test_rabenseifner_in_place_and_with_a_deadline(world):
    send = np.arange(12345.0) * (world.rank + 1)
    expected = np.empty_like(send)
    world.comm.Allreduce(send, expected)
    allreduce(world.comm, send, send, ReduceOp.SUM, Deadline.after(60.0), "rabenseifner")
    np.testing.assert_array_equal(send, expected)


def test_a_user_asks_for_rabenseifner_by_name(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    options = ms.CommunicationOptions(algorithm="rabenseifner")
    grads = [np.full((300, 7), float(world.rank)), np.arange(5.0)]
    with algorithms.recording() as log:
        total = strategy.extended.engine.all_reduce(grads, "SUM", options)
    # the schedule's steps were played (not MPI's own Allreduce): log2 rounds each way
    assert (world.size == 1) == (not any(event[0] == "step" for event in log)), log
    n = world.size
    np.testing.assert_array_equal(total[0], np.full((300, 7), n * (n - 1) / 2))
    np.testing.assert_array_equal(total[1], np.arange(5.0) * n)
    mean = strategy.extended.engine.all_reduce(np.ones(2 << 20, np.float32), "MEAN", options)
    np.testing.assert_array_equal(mean, np.ones(2 << 20, np.float32))


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner"])
def test_compiled_schedules_serve_each_size_and_place_with_mpi_bits(world, algorithm):
    """Both schedules are compiled once per (rank, size, count, place) and reused: a size
    seen out of place, then in place, then out of place again (into a buffer that is a view
    of its input's memory), and a second size, must each give MPI's own sums every time."""
    rng = np.random.default_rng(7 + world.rank)
    for count in (4099, 1 << 16, 4099, 5, 1 << 16):
        for place in ("apart", "in place", "apart", "overlapping"):
            values = rng.integers(-40, 40, count).astype(np.float64)
            expected = np.empty_like(values)
            world.comm.Allreduce(values, expected)
            if place == "in place":
                allreduce(world.comm, values, values, ReduceOp.SUM, None, algorithm)
                result = values
            elif place == "overlapping":   # (a view of the input: may_share_memory is true)
                backing = np.concatenate([values, np.zeros(1)])
                result = backing[:count]
                allreduce(world.comm, backing[:count], result, ReduceOp.SUM, None, algorithm)
            else:
                result = np.full_like(values, np.nan)
                allreduce(world.comm, values, result, ReduceOp.SUM, None, algorithm)
            np.testing.assert_array_equal(result, expected, err_msg=f"{count} {place}")
    if world.size > 1:
        keys = [k for k in algorithms._COMPILED if k[0] == algorithm and k[1] == world.rank and
                k[2] == world.size and k[3] in (4099, 1 << 16, 5)]
        assert {(k[3], k[4]) for k in keys} == {(n, apart) for n in (4099, 1 << 16, 5)
                                                 for apart in (True, False)}, keys
