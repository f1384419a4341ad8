"""The engine plays exactly the steps the simulator plays, at 1-4 ranks.

``algorithms.recording()`` records what a real run sends and receives (peers,
element ranges, combine or place) and which library collectives it calls;
``mpistrat.simulate.programs.events`` derives the same from the schedules the
simulator plays. They must be equal for every algorithm, several sizes and
node layouts, uneven node sizes included; and the results must be right.
"""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import algorithms
from mpistrat.collectives.backends import hierarchical
from mpistrat.collectives.backends.host import host_allreduce
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.topology import make_topology
from mpistrat.runtime import get_world
from mpistrat.simulate import programs

COUNTS = (0, 1, 5, 1000, 4099)


def _layouts(size):
    """Node of each rank: one node, one rank per node, pairs, and uneven nodes."""
    layouts = {"one-node": [0] * size, "one-per-node": list(range(size)),
               "pairs": [r // 2 for r in range(size)],
               "first-alone": [0] + [1] * (size - 1), "last-alone": [0] * (size - 1) + [1]}
    return {name: nodes for name, nodes in layouts.items() if len(nodes) == size}


@pytest.fixture(scope="module")
def comm():
    comm = get_world().comm.Dup()   # a duplicate of the world: its ranks are world ranks
    yield comm
    comm.Free()


def _run(comm, algorithm, send, recv, nodes):
    if algorithm == "hierarchical":
        comms = hierarchical.HierarchicalComms(comm, None,
                                               make_topology(nodes, [None] * len(nodes)))
        with algorithms.recording() as log:
            hierarchical.host_allreduce(comm, send, recv, ReduceOp.SUM, None, comms)
        return log
    with algorithms.recording() as log:
        algorithms.allreduce(comm, send, recv, ReduceOp.SUM, None, algorithm)
    return log


@pytest.mark.parametrize("algorithm", programs.ENGINE_ALGORITHMS)
def test_the_engine_plays_the_simulated_schedule(comm, algorithm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for layout, nodes in _layouts(size).items():
        for count in COUNTS:
            send = np.arange(count, dtype=np.int64) * (rank + 1)
            recv = np.empty_like(send)
            log = _run(comm, algorithm, send, recv, nodes)
            expected = programs.events(algorithm, count, nodes)[rank]
            assert log == expected, (f"{algorithm} {layout} count={count} rank {rank}: the "
                                     f"engine played {log}, the simulator plays {expected}")
            np.testing.assert_array_equal(recv, np.arange(count) * (size * (size + 1) // 2),
                                          err_msg=f"{algorithm} {layout} {count}")


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "hierarchical"])
def test_the_backend_path_plays_the_same_schedule(comm, algorithm):
    """Through the host backend's own dispatch (the topology measured, not given)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    nodes = comm.allgather(get_world().node_index)
    send = np.ones(3000, dtype=np.float32) * rank
    recv = np.empty_like(send)
    with algorithms.recording() as log:
        used = host_allreduce(comm, send, recv, ReduceOp.SUM, None, preference=algorithm)
    assert used == ("mpi" if size == 1 else algorithm)
    expected = programs.events(used, send.size, nodes)[rank]
    assert log == expected
    np.testing.assert_array_equal(recv, np.full(3000, size * (size - 1) / 2, np.float32))


def test_recording_is_off_outside_the_block(comm):
    send = np.ones(10)
    with algorithms.recording() as log:
        pass
    algorithms.allreduce(comm, send, send.copy(), ReduceOp.SUM, None, "ring")
    assert log == [] and algorithms._recording is None
    assert ms  # the package is importable alongside
