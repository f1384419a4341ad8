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
