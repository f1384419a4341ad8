"""The hierarchical all-reduce on host buffers, on simulated node layouts (1-4 ranks).

Each layout gives every rank a node label; the result must equal MPI's own
Allreduce for every op, dtype and size, including sizes smaller than the
number of chunks and nodes of different sizes.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.collectives.algorithms import HIERARCHICAL_THRESHOLD_BYTES
from mpistrat.collectives.backends import hierarchical
from mpistrat.collectives.backends.host import host_allreduce as chosen_allreduce
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.topology import comm_topology, make_topology
from mpistrat.runtime import get_world

pytestmark = pytest.mark.numpy_only("the host-buffer algorithm against MPI's own Allreduce")


def _layouts(size):
    """Node labels per rank: one node, one rank per node, pairs, uneven and interleaved."""
    layouts = {"one-node": [0] * size, "one-per-node": list(range(size)),
               "pairs": [r // 2 for r in range(size)],
               "first-alone": [0] + [1] * (size - 1), "last-alone": [0] * (size - 1) + [1],
               "interleaved": [r % 2 for r in range(size)]}
    return {name: nodes for name, nodes in layouts.items() if len(nodes) == size}


@pytest.fixture(scope="module")
def comm():
    comm = get_world().comm.Dup()
    yield comm
    comm.Free()


@pytest.mark.parametrize("layout", ["one-node", "one-per-node", "pairs", "first-alone",
                                    "last-alone", "interleaved"])
def test_hierarchical_matches_mpi_allreduce(comm, layout):
    size, rank = comm.Get_size(), comm.Get_rank()
    nodes = _layouts(size)[layout]
    comms = hierarchical.HierarchicalComms(comm, None, make_topology(nodes, [None] * size))
    rng = np.random.default_rng(rank)
    for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX):
        for dtype in (np.float64, np.int32, np.uint8):
            for count in (0, 1, 3, 1000, 4099):
                send = rng.integers(0, 50, count).astype(dtype)  # exact in any order, no uint8 overflow
                expected = np.empty_like(send)
                comm.Allreduce(send, expected, op.mpi_op)
                recv = np.empty_like(send)
                hierarchical.host_allreduce(comm, send, recv, op, None, comms)
                np.testing.assert_array_equal(recv, expected, err_msg=f"{op} {dtype} {count}")
    # in place, with a deadline (the non-blocking path)
    send = np.arange(10.0) + rank
    expected = np.empty_like(send)
    comm.Allreduce(send, expected, MPI.SUM)
    hierarchical.host_allreduce(comm, send, send, ReduceOp.SUM, Deadline.after(30.0), comms)
    np.testing.assert_array_equal(send, expected)


def test_engine_picks_hierarchical_where_the_topology_asks(comm):
    """Under MPISTRAT_RANKS_PER_NODE the world's layout decides the algorithm."""
    world = get_world()
    topology = comm_topology(comm)
    assert topology.nodes == tuple(np.unique(
        comm.allgather(world.node_index), return_inverse=True)[1].tolist()) or \
        topology.num_nodes == world.num_nodes
    send = np.full(HIERARCHICAL_THRESHOLD_BYTES // 8, float(comm.Get_rank() + 1))  # at both
    # thresholds (ring and hierarchical)
    recv = np.empty_like(send)
    used = chosen_allreduce(comm, send, recv, ReduceOp.SUM, None)
    size = comm.Get_size()
    np.testing.assert_array_equal(recv, np.full_like(send, size * (size + 1) / 2))
    if size == 1:
        assert used == "mpi"
    elif topology.num_nodes == 1:
        assert used == "ring"
    elif max(topology.node_sizes) == 1:  # one rank per host: ring from 3 hosts, else MPI's
        assert used == ("ring" if topology.num_nodes >= 3 else "mpi")
    else:
        assert used == "hierarchical"


def test_strategy_reduce_across_simulated_nodes():
    """End to end: a large mirrored reduce and a fused small one under the current layout."""
    import mpistrat as ms
    strategy = ms.MultiWorkerMirroredStrategy()
    n, rank = strategy.num_replicas_in_sync, get_world().rank
    big = np.full((3, 1 << 17), rank, np.float32)  # 1.5 MiB
    out = strategy.reduce("SUM", {"big": big, "small": np.int64(rank)}, axis=None)
    np.testing.assert_array_equal(out["big"], np.full_like(big, n * (n - 1) / 2))
    assert out["small"] == n * (n - 1) // 2
    mean = strategy.reduce("MEAN", big, axis=None)
    np.testing.assert_allclose(mean, np.full_like(big, (n - 1) / 2))
    assert strategy.reduce("MAX", np.bool_(rank == n - 1), axis=None)


def test_staged_pipeline_over_real_mpi(comm):
    """The staging pipeline with NumPy for device memory and the real host all-reduce."""
    from mpistrat.collectives.backends.pipeline import NumpyStager, chunk_ranges, run_pipeline
    size, rank = comm.Get_size(), comm.Get_rank()
    device_in = np.arange(3 << 18, dtype=np.float32) + rank       # 3 MiB in 1 MiB chunks
    device_out = np.empty_like(device_in)
    host = np.empty_like(device_in)
    stager = NumpyStager()
    used = []
    run_pipeline(stager, device_in, device_out, host,
                 chunk_ranges(device_in.size, 4, chunk_bytes=1 << 20),
                 lambda chunk: used.append(chosen_allreduce(comm, chunk, chunk, ReduceOp.SUM,
                                                            None)))
    stager.close()
    expected = size * np.arange(3 << 18, dtype=np.float32) + size * (size - 1) / 2
    np.testing.assert_array_equal(device_out, expected)
    assert len(used) == 3


@pytest.mark.parametrize("ops", ["ReductionToOneDevice", "HierarchicalCopyAllReduce"])
def test_cross_device_ops_reduce_correctly(ops):
    import mpistrat as ms
    world = get_world()
    if world.num_nodes > 1:
        pytest.skip("MirroredStrategy spans one node")
    strategy = ms.MirroredStrategy(cross_device_ops=getattr(ms.distribute, ops)())
    n, rank = strategy.num_replicas_in_sync, world.local_rank
    value = np.full(1 << 18, rank, np.float64)
    out = strategy.reduce("MEAN", {"v": value, "s": np.float32(rank)}, axis=None)
    np.testing.assert_allclose(out["v"], (n - 1) / 2)
    assert out["s"] == np.float32((n - 1) / 2)
