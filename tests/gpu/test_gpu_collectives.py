"""CuPy (and JAX GPU) values through the engine and strategies, on whichever backend the
layout makes us choose: NCCL at 1 rank, staged at 2 ranks on one GPU, hierarchical (NCCL
inside each simulated node, MPI across) at 2 nodes x 1 rank."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine, CommunicationOptions
from mpistrat.collectives.backends import NcclInitError, explain_backend
from mpistrat.collectives.topology import comm_topology
from mpistrat.runtime.devices import capabilities
from mpistrat.runtime.gpus import bound_device


def _cupy():
    import cupy
    return cupy


def test_rank_is_bound_to_its_gpu(strategy, world):
    cupy = _cupy()
    bound = bound_device()
    assert bound.kind == "GPU"
    visible = cupy.cuda.runtime.getDeviceCount()
    assert bound.index == world.local_rank % visible
    assert cupy.cuda.Device().id == bound.index
    assert strategy.extended.worker_devices[0].endswith(f"device:GPU:{bound.index}")
    assert len(ms.config.list_physical_devices("GPU")) == visible


def test_backend_follows_the_layout(strategy):
    comm = strategy.extended.engine.comm
    topology = comm_topology(comm)
    caps = capabilities()
    backend, why = explain_backend("cupy", ms.CommunicationImplementation.AUTO, caps, topology)
    if topology.gpu_shared_in_node:
        assert backend.name in ("staged-host-mpi", "cuda-aware-mpi"), why
    else:
        assert backend.name == "nccl", why
        algorithm = backend.algorithm_for(1 << 20, comm.Get_size(), topology)[0]
        assert algorithm == ("hierarchical" if topology.gpu_shared else "nccl")


@pytest.mark.parametrize("implementation", ["AUTO", "MPI"])
def test_all_reduce_ops_dtypes_and_fusion(strategy, world, implementation):
    cupy = _cupy()
    engine = strategy.extended.engine
    opts = CommunicationOptions(implementation=implementation)
    n, r = world.size, world.rank
    values = {"f32": cupy.full((3, 5), r + 1, cupy.float32),
              "f16": cupy.full(7, r + 1, cupy.float16),
              "i32": cupy.arange(4, dtype=cupy.int32) * (r + 1),
              "i16": cupy.full(3, r, cupy.int16),                 # NCCL lacks int16: staged
              "big": cupy.full(1 << 20, float(r), cupy.float32)}  # 4 MiB: travels alone
    total = n * (n + 1) / 2
    out = engine.all_reduce(values, "SUM", opts)
    assert all(isinstance(v, cupy.ndarray) for v in out.values())
    assert out["f16"].dtype == cupy.float16
    cupy.testing.assert_array_equal(out["f32"], cupy.full((3, 5), total, cupy.float32))
    cupy.testing.assert_array_equal(out["f16"], cupy.full(7, total, cupy.float16))
    cupy.testing.assert_array_equal(out["i32"], cupy.arange(4, dtype=cupy.int32) * int(total))
    cupy.testing.assert_array_equal(out["i16"], cupy.full(3, n * (n - 1) // 2, cupy.int16))
    cupy.testing.assert_array_equal(out["big"], cupy.full(1 << 20, n * (n - 1) / 2, cupy.float32))
    mean = engine.all_reduce(values["f32"], "MEAN", opts)
    cupy.testing.assert_allclose(mean, cupy.full((3, 5), total / n))
    assert int(engine.all_reduce(cupy.array(r), "MAX", opts)) == n - 1
    assert int(engine.all_reduce(cupy.array(r), "MIN", opts)) == 0
    flags = engine.all_reduce(cupy.array([r == 0, True]), "MIN", opts)
    assert flags.dtype == cupy.bool_ and flags.tolist() == [n == 1, True]
    with pytest.raises(TypeError, match="bool"):
        engine.all_reduce(cupy.array([True]), "SUM", opts)


def test_uneven_all_gather_and_broadcast(strategy, world):
    cupy = _cupy()
    engine = strategy.extended.engine
    r, n = world.rank, world.size
    mine = cupy.full((r + 1, 2), r, cupy.float64)
    gathered = engine.all_gather(mine, axis=0)
    assert isinstance(gathered, cupy.ndarray) and gathered.shape == (n * (n + 1) // 2, 2)
    assert gathered[:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)]
    half = engine.broadcast(cupy.full(5, r, cupy.float16), root=n - 1)
    assert half.dtype == cupy.float16 and half.tolist() == [n - 1] * 5


def test_strategy_run_reduce_gather_and_replica_context(strategy, world):
    cupy = _cupy()
    r, n = world.rank, world.size

    def step(x):
        ctx = ms.get_replica_context()
        return ctx.all_reduce("SUM", x), x * 2

    summed, doubled = strategy.run(step, args=(cupy.full(3, r + 1.0),))
    assert isinstance(summed, cupy.ndarray) and summed.tolist() == [n * (n + 1) / 2] * 3
    total = strategy.reduce("SUM", doubled, axis=None)
    assert float(total[0]) == n * (n + 1)
    rows = strategy.reduce("MEAN", cupy.full((r + 1, 2), float(r)), axis=0)
    assert isinstance(rows, cupy.ndarray)
    expected = sum(k * (k + 1) for k in range(n)) / sum(k + 1 for k in range(n))
    cupy.testing.assert_allclose(rows, cupy.full(2, expected))
    gathered = strategy.gather(cupy.full((1, 2), r), axis=0)
    assert gathered[:, 0].tolist() == list(range(n))


def test_variables_live_on_the_gpu_and_stay_mirrored(strategy, world):
    cupy = _cupy()
    with strategy.scope():
        w = ms.Variable(np.full(4, float(world.rank)), aggregation=ms.VariableAggregation.MEAN)
    assert isinstance(w.read_value(), cupy.ndarray)       # device-resident
    assert w.numpy().tolist() == [0.0] * 4                # rank 0's initial value, on the host
    strategy.run(lambda: w.assign_add(cupy.full(4, float(world.rank))))
    expected = (world.size - 1) / 2
    cupy.testing.assert_allclose(w.read_value(), cupy.full(4, expected))
    assert isinstance(w.numpy(), np.ndarray)


def test_timeout_is_honoured_by_polling(strategy, world):
    cupy = _cupy()
    engine = CollectiveEngine(strategy.extended.engine.comm.Dup(),
                              CommunicationOptions(timeout_seconds=30.0))
    out = engine.all_reduce(cupy.ones(1 << 16, cupy.float32), "SUM")
    cupy.cuda.get_current_stream().synchronize()
    assert float(out[0]) == world.size


def test_jax_gpu_arrays_reach_the_backend_through_dlpack(strategy, world):
    jax = pytest.importorskip("jax")
    if not any(d.platform in ("gpu", "cuda") for d in jax.devices()):
        pytest.skip("JAX sees no GPU here")
    x = jax.numpy.full(8, float(world.rank + 1))
    out = strategy.extended.engine.all_reduce(x, "SUM")
    assert "jax" in type(out).__module__
    assert np.asarray(out).tolist() == [world.size * (world.size + 1) / 2] * 8


def test_forced_nccl_with_two_ranks_on_one_gpu_fails_on_every_rank(strategy, world):
    topology = comm_topology(strategy.extended.engine.comm)
    if not topology.gpu_shared_in_node:
        pytest.skip("every rank of each node has its own GPU here")
    cupy = _cupy()
    engine = CollectiveEngine(strategy.extended.engine.comm.Dup(), CommunicationOptions(
        implementation="NCCL", timeout_seconds=60.0))
    with pytest.raises(NcclInitError, match=f"rank {world.rank}.*own GPU"):
        engine.all_reduce(cupy.ones(4), "SUM")
