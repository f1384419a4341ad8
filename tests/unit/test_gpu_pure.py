"""GPU support that runs without a GPU: device choice, backend choice, refusal of device
buffers by host MPI, fusion and staging logic, cross_device_ops mapping."""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.collectives.algorithms import explain_algorithm
from mpistrat.collectives.backends import (BACKENDS, DeviceBufferRefused, HostMPI,
                                           explain_backend, select_backend)
from mpistrat.collectives.backends.base import plan_members
from mpistrat.collectives.backends.describe import describe_backends
from mpistrat.collectives.backends.nccl import init_hint
from mpistrat.collectives.backends.pipeline import (HostBufferPool, NumpyStager, chunk_ranges,
                                                    run_pipeline, schedule)
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.topology import make_topology, single_node
from mpistrat.runtime import devices
from mpistrat.runtime.devices import Capabilities, array_kind
from mpistrat.runtime.gpus import (choose_gpu, device_for_rank, parse_device, shared_gpu_ranks,
                                   visible_gpu_ids)

Impl = ms.CommunicationImplementation
NONE = Capabilities(cuda_aware_mpi=False, nccl=False, cupy=False)
GPU = Capabilities(cuda_aware_mpi=False, nccl=True, cupy=True)


class FakeDeviceArray:
    """Stands for a foreign GPU array: it exposes __cuda_array_interface__ and nothing else."""

    def __init__(self, shape=(4,), dtype=np.float32):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": self.dtype.str,
                                         "data": (0xDEAD0000, False), "version": 3}


# -- device binding ------------------------------------------------------------

def test_gpu_choice_by_local_rank_and_visible_devices():
    assert [choose_gpu(r, 4, {}).index for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert choose_gpu(3, 2, {"CUDA_VISIBLE_DEVICES": "4,5"}).index == 1
    # Slurm's per-task binding leaves one GPU visible: always that one
    one = choose_gpu(3, 1, {"CUDA_VISIBLE_DEVICES": "6"})
    assert one.index == 0 and "Slurm" in one.reason
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "0,2,-1,3"}) == ("0", "2")
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == ()
    with pytest.raises(ValueError, match="no GPU"):
        choose_gpu(0, 0, {})


def test_named_devices_map_local_ranks_and_disagreement_is_explained():
    assert parse_device("/job:worker/replica:0/task:1/device:GPU:3") == ("GPU", 3)
    assert device_for_rank(["GPU:0", "GPU:1"], 1, 2, 2) == ("GPU", 1)
    assert device_for_rank(["/cpu:0", "/cpu:0"], 0, 2, 0) == ("CPU", 0)
    with pytest.raises(ValueError, match="3 ranks run on this node"):
        device_for_rank(["GPU:0", "GPU:1"], 0, 3, 2)
    with pytest.raises(ValueError, match="twice"):
        device_for_rank(["GPU:0", "GPU:0"], 0, 2, 2)
    with pytest.raises(ValueError, match="sees 1 GPU"):
        device_for_rank(["GPU:0", "GPU:1"], 1, 2, 1)
    with pytest.raises(ValueError, match="mix"):
        device_for_rank(["GPU:0", "CPU:0"], 0, 2, 1)
    with pytest.raises(ValueError, match="not of the form"):
        parse_device("TPU:0")
    assert shared_gpu_ranks([("h", "a"), ("h", "b"), ("h", "a"), None]) == ((0, 2),)


def test_physical_devices_and_host_replicas_without_gpu():
    assert ms.config.list_physical_devices("CPU")[0].device_type == "CPU"
    assert ms.config.list_physical_devices("GPU") == []  # no GPU on the CI machine
    strategy = ms.MirroredStrategy()
    assert strategy.extended.worker_devices[0].endswith("device:CPU:0")


# -- capability detection, forced on and off ----------------------------------

@pytest.mark.parametrize("value,expected", [("1", True), ("0", False)])
def test_cuda_awareness_forced(monkeypatch, value, expected):
    devices.cuda_aware_mpi.cache_clear()
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE_MPI", value)
    try:
        assert devices.cuda_aware_mpi() == (expected, f"MPISTRAT_CUDA_AWARE_MPI={value}")
    finally:
        devices.cuda_aware_mpi.cache_clear()


def test_nccl_forced_off_and_missing(monkeypatch):
    devices.nccl_available.cache_clear()
    monkeypatch.setenv("MPISTRAT_NCCL", "0")
    assert devices.nccl_available() == (False, "MPISTRAT_NCCL=0")
    devices.nccl_available.cache_clear()
    monkeypatch.delenv("MPISTRAT_NCCL")
    ok, why = devices.nccl_available()
    assert not ok and "cupy" in why  # CuPy is not installed on CPU machines
    devices.nccl_available.cache_clear()


# -- backend choice ------------------------------------------------------------

def test_backend_order_and_choice():
    assert [b.name for b in BACKENDS] == ["nccl", "cuda-aware-mpi", "staged-host-mpi",
                                          "host-mpi"]
    two_gpus = make_topology([0, 0], ["a", "b"])
    shared = make_topology([0, 0], ["a", "a"])
    assert select_backend("numpy", Impl.AUTO, GPU, two_gpus).name == "host-mpi"
    assert select_backend("cupy", Impl.AUTO, GPU, two_gpus).name == "nccl"
    backend, why = explain_backend("cupy", Impl.AUTO, GPU, shared)
    assert backend.name == "staged-host-mpi"
    assert explain_backend("cupy", Impl.NCCL, GPU, shared)[0].name == "nccl"  # forced: tried
    aware = Capabilities(cuda_aware_mpi=True, nccl=False, cupy=True)
    assert select_backend("cupy", Impl.AUTO, aware).name == "cuda-aware-mpi"
    assert select_backend("cupy", Impl.MPI, Capabilities(True, True, True),
                          two_gpus).name == "cuda-aware-mpi"
    assert select_backend("jax", Impl.AUTO, NONE).name == "staged-host-mpi"
    with pytest.raises(ValueError, match="nccl: NCCL is unavailable"):
        select_backend("cupy", Impl.NCCL, NONE)
    with pytest.raises(ValueError, match="foreign CUDA arrays"):
        select_backend("cuda", Impl.AUTO, NONE)


def test_algorithm_chosen_by_topology():
    one_node = single_node(4)
    two_by_two = make_topology([0, 0, 1, 1], [None] * 4)
    three_by_one = make_topology([0, 1, 2], [None] * 3)
    assert explain_algorithm(64 << 20, 4, topology=one_node)[0] == "ring"
    assert explain_algorithm(64 << 20, 4, topology=two_by_two)[0] == "hierarchical"
    assert explain_algorithm(1 << 10, 4, topology=two_by_two)[0] == "mpi"
    algorithm, why = explain_algorithm(64 << 20, 3, topology=three_by_one)
    assert algorithm == "ring" and "fewer bytes over each host link" in why
    two_by_one = make_topology([0, 1], [None] * 2)
    assert explain_algorithm(64 << 20, 2, topology=two_by_one)[0] == "mpi"
    assert explain_algorithm(8, 4, preference="reduce_broadcast")[0] == "reduce_broadcast"
    # in place on one node, MPI's own up to the in-place threshold, the ring from there;
    # across nodes the place changes nothing
    for nbytes in (1 << 20, 4 << 20, 16 << 20):
        assert explain_algorithm(nbytes, 4, topology=one_node)[0] == "ring"
        assert explain_algorithm(nbytes, 4, topology=one_node, in_place=True)[0] == "mpi"
    assert explain_algorithm(64 << 20, 4, topology=one_node, in_place=True)[0] == "ring"
    assert explain_algorithm(64 << 20, 4, topology=two_by_two, in_place=True)[0] == \
        "hierarchical"
    assert explain_algorithm(4 << 20, 3, topology=three_by_one, in_place=True)[0] == "ring"
    assert explain_algorithm(4 << 20, 4, threshold=1 << 20, in_place=True)[0] == "ring"
    with pytest.raises(ValueError):
        explain_algorithm(8, 4, preference="butterfly")
    # NCCL: its own algorithm, hierarchical where ranks on different nodes share a GPU
    nccl = BACKENDS[0]
    assert nccl.algorithm_for(1 << 20, 2, make_topology([0, 0], ["a", "b"]))[0] == "nccl"
    assert nccl.algorithm_for(1 << 20, 2, make_topology([0, 1], ["a", "a"]))[0] == "hierarchical"


def test_describe_backends_says_what_and_why():
    rows = describe_backends(4, make_topology([0, 0, 1, 1], [None] * 4), caps=NONE)
    by = {(r["kind"], r["bytes"]): r for r in rows}
    assert by[("numpy", 256 << 20)]["algorithm"] == "hierarchical"
    assert by[("numpy", 4 << 10)]["algorithm"] == "mpi"
    assert by[("cupy", 1 << 20)]["backend"] == "staged-host-mpi"
    assert "pinned" in by[("cupy", 1 << 20)]["why"]
    gpu_rows = describe_backends(2, make_topology([0, 0], ["a", "b"]), caps=GPU, kinds=("cupy",))
    assert {r["backend"] for r in gpu_rows} == {"nccl"}
    refused = describe_backends(2, caps=NONE, implementation="NCCL", kinds=("cupy",))
    assert all("error" in r for r in refused)


def test_nccl_init_hint_names_two_ranks_on_one_gpu():
    assert "own GPU" in init_hint([None, "ncclInvalidUsage: Duplicate GPU detected"], False)
    assert "own GPU" in init_hint([None, None], True)
    assert "NCCL_DEBUG" in init_hint(["ncclSystemError: socket"], False)


# -- device buffers never reach a non-CUDA-aware MPI ---------------------------

def test_host_backend_refuses_device_buffers_by_name():
    fake = FakeDeviceArray()
    assert array_kind(fake) == "cuda"
    host = HostMPI()
    for call in (lambda: host.all_reduce(MPI.COMM_SELF, [np.ones(2), fake], ReduceOp.SUM,
                                         ms.CommunicationOptions(), None),
                 lambda: host.all_gather(MPI.COMM_SELF, [fake], [[4]], 0, None),
                 lambda: host.broadcast(MPI.COMM_SELF, [fake], 0, None)):
        with pytest.raises(DeviceBufferRefused, match="tensor .*FakeDeviceArray.*CUDA-aware"):
            call()


def test_engine_never_hands_device_buffers_to_host_mpi():
    engine = ms.MultiWorkerMirroredStrategy().extended.engine
    with pytest.raises(ValueError, match="no collective backend serves cuda arrays"):
        engine.all_reduce([np.ones(2), FakeDeviceArray()], "SUM")


# -- fusion plans and staging ---------------------------------------------------

def test_fusion_plan_members_for_device_buckets():
    plan = plan_members([(3,), (2, 2), (1 << 20,), (5,)], ["<f4", "<f4", "<f4", "<i4"],
                        [12, 16, 4 << 20, 20], pack_bytes=64)
    assert [(b.indices, count, members) for b, count, members in plan] == [
        ((0, 1), 7, [(0, 0, 3), (1, 3, 7)]), ((2,), 1 << 20, [(2, 0, 1 << 20)]),
        ((3,), 5, [(3, 0, 5)])]


def test_pipeline_schedule_overlaps_copies_with_reduction():
    steps = schedule(4)
    position = {step: i for i, step in enumerate(steps)}
    for i in range(4):
        assert position[("down", i)] < position[("wait", i)] < position[("reduce", i)] \
            < position[("up", i)]
        if i + 1 < 4:  # the next chunk is on its way while this one is reduced
            assert position[("down", i + 1)] < position[("reduce", i)]
    assert schedule(0) == [] and chunk_ranges(0, 4) == [(0, 0)]
    assert chunk_ranges(10, 8, chunk_bytes=32) == [(0, 4), (4, 8), (8, 10)]


def test_pipeline_with_numpy_standing_for_device_memory():
    stager = NumpyStager()
    device_in = np.arange(1000, dtype=np.float64)
    device_out = np.zeros_like(device_in)
    host = np.empty_like(device_in)
    reduced = []

    def reduce_chunk(view):  # stands for the host all-reduce of 3 equal ranks
        reduced.append(view.size)
        view *= 3

    ranges = chunk_ranges(device_in.size, 8, chunk_bytes=8 * 300)
    run_pipeline(stager, device_in, device_out, host, ranges, reduce_chunk)
    stager.close()
    np.testing.assert_array_equal(device_out, device_in * 3)
    assert reduced == [300, 300, 300, 100]
    downs = [entry for entry in stager.log if entry[0] == "down"]
    assert [d[1:] for d in downs] == ranges          # copies ran in stream order
    assert stager.log.index(("down", 300, 600)) < stager.log.index(("up", 0, 300))


def test_host_buffer_pool_reuses_persistent_buffers():
    made = []
    pool = HostBufferPool(lambda n: made.append(n) or np.empty(n, np.uint8))
    first = pool.take(1000)
    pool.give(first)
    again = pool.take(900)
    assert again is first and made == [4096] and pool.allocations == 1
    other = pool.take(900)  # the first is still lent: a second buffer
    assert other is not first and pool.allocations == 2


# -- cross_device_ops -------------------------------------------------------------

def test_cross_device_ops_map_to_backends_and_algorithms():
    hier = ms.distribute.HierarchicalCopyAllReduce(num_packs=1).communication_options()
    assert hier.algorithm == "hierarchical" and hier.implementation is Impl.AUTO
    one = ms.distribute.ReductionToOneDevice().communication_options()
    assert one.algorithm == "reduce_broadcast"
    nccl = ms.distribute.NcclAllReduce(num_packs=0).communication_options()
    assert nccl.implementation is Impl.NCCL and nccl.bytes_per_pack == 1  # no fusion
    with pytest.raises(ValueError, match="num_packs"):
        ms.distribute.NcclAllReduce(num_packs=-1)
    strategy = ms.MirroredStrategy(cross_device_ops=ms.distribute.ReductionToOneDevice())
    assert strategy.extended.engine.options.algorithm == "reduce_broadcast"
    assert strategy.reduce("SUM", np.arange(3.0), axis=None).tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="needs GPU replicas"):
        ms.MirroredStrategy(cross_device_ops=ms.distribute.NcclAllReduce())
    with pytest.raises(ValueError, match="needs GPU replicas"):
        ms.MultiWorkerMirroredStrategy(communication_options=ms.CommunicationOptions(
            implementation="NCCL"))
    with pytest.raises(ValueError, match="cross_device_ops must be"):
        ms.MirroredStrategy(cross_device_ops="nccl")


@pytest.mark.parametrize("module", [
    "mpistrat.runtime.gpus", "mpistrat.collectives.topology", "mpistrat.collectives.algorithms",
    "mpistrat.collectives.backends", "mpistrat.collectives.backends.base",
    "mpistrat.collectives.backends.host", "mpistrat.collectives.backends.pipeline",
    "mpistrat.collectives.backends.hierarchical", "mpistrat.collectives.backends.staged",
    "mpistrat.collectives.backends.cuda_aware", "mpistrat.collectives.backends.nccl",
    "mpistrat.collectives.backends.describe", "mpistrat.distribute.cross_device_ops",
    "mpistrat.config"])
def test_docstring_examples(module):
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0
