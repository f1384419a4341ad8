"""The staged backend's device path (fuse on the device, pipeline each bucket through a
reused host buffer in chunks, unpack) with NumPy standing for device memory, against the
host backend, at 1-4 ranks."""

import numpy as np
import pytest

from mpistrat.collectives.backends import HostMPI, StagedHostMPI
from mpistrat.collectives.backends.pipeline import HostBufferPool, NumpyStager
from mpistrat.collectives.options import CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.runtime import get_world

pytestmark = pytest.mark.numpy_only("NumPy stands for device memory here by design")


@pytest.fixture(scope="module")
def comm():
    comm = get_world().comm.Dup()
    yield comm
    comm.Free()


def _values(rank):
    rng = np.random.default_rng(rank)
    return [rng.integers(-50, 50, (3, 4)).astype(np.float32),
            rng.integers(-50, 50, 7).astype(np.float16),
            rng.integers(-50, 50, 5).astype(np.int32),
            np.array(rank % 2 == 0),
            rng.integers(-50, 50, 40_000).astype(np.float64),   # 320 kB: several chunks
            np.arange(6, dtype=np.int64).reshape(2, 3) * (rank + 1)]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MIN, ReduceOp.MAX])
def test_pipelined_device_path_matches_host_backend(comm, op):
    values = _values(comm.Get_rank())
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        values = [v for v in values if v.dtype != np.bool_]
    made = []
    pool = HostBufferPool(lambda n: made.append(n) or np.empty(n, np.uint8))
    staged = StagedHostMPI()
    opts = CommunicationOptions(bytes_per_pack=256)
    expected = HostMPI().all_reduce(comm, values, op, opts, None)
    for _ in range(2):  # the second call reuses the host buffers of the first
        got = staged.pipelined_all_reduce(comm, values, op, opts, None, np, NumpyStager, pool,
                                          chunk_bytes=64 << 10)
        for index, (g, e, v) in enumerate(zip(got, expected, values)):
            assert g.dtype == v.dtype and g.shape == v.shape, index
            np.testing.assert_array_equal(g, e, err_msg=f"tensor {index} {op}")
    assert pool.allocations == len(made) <= 4  # buckets share sizes: no allocation per call


def test_timed_pipeline_and_in_place_algorithms(comm):
    n = comm.Get_size()
    value = np.full(50_000, float(comm.Get_rank()), np.float32)
    staged = StagedHostMPI()
    pool = HostBufferPool(lambda k: np.empty(k, np.uint8))
    from mpistrat.collectives.deadline import Deadline
    for algorithm in ("auto", "ring", "mpi", "reduce_broadcast", "hierarchical"):
        opts = CommunicationOptions(algorithm=algorithm)
        out, = staged.pipelined_all_reduce(comm, [value], ReduceOp.SUM, opts,
                                           Deadline.after(30.0), np, NumpyStager, pool,
                                           chunk_bytes=32 << 10)
        np.testing.assert_array_equal(out, np.full_like(value, n * (n - 1) / 2),
                                      err_msg=algorithm)


@pytest.mark.parametrize("algorithm", ["auto", "mpi", "hierarchical", "reduce_broadcast"])
def test_cuda_aware_backend_logic_with_numpy_for_device_memory(comm, algorithm):
    """The CUDA-aware backend passes buffers to MPI itself; with NumPy standing for device
    memory its fusion, algorithms (MPI's own collectives in the hierarchical steps), gather
    and broadcast are checked against the host backend."""
    from mpistrat.collectives.backends import CudaAwareMPI
    backend = CudaAwareMPI(xp=np)
    values = _values(comm.Get_rank())
    values = [v for v in values if v.dtype != np.bool_]
    opts = CommunicationOptions(bytes_per_pack=256, algorithm=algorithm)
    for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX):
        expected = HostMPI().all_reduce(comm, values, op, opts, None)
        for g, e in zip(backend.all_reduce(comm, values, op, opts, None), expected):
            np.testing.assert_array_equal(g, e)
    n, r = comm.Get_size(), comm.Get_rank()
    rows = np.full((r + 1, 2), r, np.int32)
    gathered, = backend.all_gather(comm, [rows], [[k + 1 for k in range(n)]], 0, None)
    assert gathered[:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)]
    shared, = backend.broadcast(comm, [np.full(3, r, np.float16)], n - 1, None)
    assert shared.tolist() == [n - 1] * 3


def test_half_precision_gathers_and_broadcasts_over_host_mpi(comm):
    """Open MPI 4.1 has no half-precision type: such values move bit for bit as uint16."""
    import mpistrat as ms
    strategy = ms.MultiWorkerMirroredStrategy()
    r, n = comm.Get_rank(), comm.Get_size()
    with strategy.scope():
        v = ms.Variable(np.full(3, r + 0.5, np.float16))   # rank 0's value everywhere
    assert v.numpy().dtype == np.float16 and v.numpy().tolist() == [0.5] * 3
    gathered = strategy.gather(np.full((1, 2), r + 0.25, np.float16), axis=0)
    assert gathered.dtype == np.float16 and gathered[:, 0].tolist() == [k + 0.25 for k in range(n)]
