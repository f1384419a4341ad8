"""Single-process API behaviour: errors, options, contexts, default strategy, devices."""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.collectives.backends import select_backend
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.runtime.devices import Capabilities, array_kind, cuda_aware_mpi
from mpistrat.runtime.gpus import choose_gpu


def test_error_classes_subclass_the_builtins():
    pairs = [(ms.errors.NotFoundError, FileNotFoundError),
             (ms.errors.InvalidArgumentError, ValueError),
             (ms.errors.DeadlineExceededError, TimeoutError),
             (ms.errors.UnavailableError, ConnectionError),
             (ms.errors.DataLossError, IOError),
             (ms.errors.AbortedError, RuntimeError)]
    for cls, builtin in pairs:
        assert issubclass(cls, builtin) and issubclass(cls, ms.errors.OpError)
        assert cls("msg").message == "msg"


def test_reduce_op_accepts_strings_in_any_case():
    assert ms.ReduceOp.from_any("sUm") is ms.ReduceOp.SUM
    assert ms.ReduceOp.from_any(ms.ReduceOp.MAX) is ms.ReduceOp.MAX
    with pytest.raises(ValueError, match="unknown reduce op"):
        ms.ReduceOp.from_any("median")


def test_communication_options_validate_and_merge():
    opts = ms.CommunicationOptions(bytes_per_pack=1024, implementation="nccl")
    assert opts.implementation is ms.CommunicationImplementation.NCCL
    assert ms.CommunicationOptions().pack_bytes > 0
    merged = opts.merge(ms.CommunicationOptions(timeout_seconds=3.0))
    assert merged.bytes_per_pack == 1024 and merged.timeout_seconds == 3.0
    with pytest.raises(ValueError):
        ms.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError):
        ms.CommunicationOptions(timeout_seconds=0)


def test_default_strategy_and_contexts_outside_any_scope():
    assert not ms.has_strategy()
    assert not ms.in_cross_replica_context()
    strategy = ms.get_strategy()
    assert strategy.num_replicas_in_sync == 1
    ctx = ms.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    assert float(ctx.all_reduce("MEAN", 4.0)) == 4.0
    with strategy.scope():
        assert not ms.has_strategy()
    assert strategy.run(lambda x: x + 1, args=(1,)) == 2


def test_scope_enters_cross_replica_context_and_run_replica_context():
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        assert ms.has_strategy() and ms.get_strategy() is strategy
        assert ms.in_cross_replica_context() and ms.get_replica_context() is None
        with strategy.scope():  # re-entrant
            assert ms.get_strategy() is strategy
        seen = strategy.run(lambda: (ms.get_replica_context(), ms.in_cross_replica_context()))
        assert seen[0].replica_id_in_sync_group == 0 and seen[1] is False
    assert not ms.has_strategy()


def test_another_strategys_scope_inside_raises():
    first, second = ms.MultiWorkerMirroredStrategy(), ms.MirroredStrategy()
    with first.scope():
        with pytest.raises(RuntimeError, match="Mixing different strategies"):
            with second.scope():
                pass


def test_run_rejects_non_sequence_args_and_nested_run():
    strategy = ms.MultiWorkerMirroredStrategy()
    with pytest.raises(ValueError, match="list or tuple"):
        strategy.run(lambda x: x, args=1.0)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.reduce("SUM", 1.0, axis=None))


def test_merge_call_runs_in_cross_replica_context():
    strategy = ms.MultiWorkerMirroredStrategy()

    def merge_fn(s, value):
        assert ms.in_cross_replica_context()
        return s.reduce("SUM", value, axis=None)

    result = strategy.run(lambda: ms.get_replica_context().merge_call(merge_fn, args=(5.0,)))
    assert result == 5.0


def test_variable_outside_scope_is_ordinary_and_supports_numpy_ops():
    v = ms.Variable([1.0, 2.0], name="w")
    assert not v.distributed
    assert repr(v) == "<ms.Variable 'w:0' shape=(2,) dtype=float64, numpy=[1., 2.]>"
    np.testing.assert_array_equal(v * 2, [2.0, 4.0])
    np.testing.assert_array_equal(np.add(v, v), [2.0, 4.0])
    v.assign([3.0, 4.0]).assign_add(1.0).assign_sub([0.5, 0.5])
    np.testing.assert_array_equal(v.numpy(), [3.5, 4.5])
    with pytest.raises(ValueError, match="does not fit"):
        v.assign(np.zeros(3))
    assert ms.Variable(lambda: 7, dtype=np.int32).numpy().dtype == np.int32


def test_input_and_value_contexts():
    ctx = ms.InputContext(num_input_pipelines=3, input_pipeline_id=2, num_replicas_in_sync=3)
    assert ctx.get_per_replica_batch_size(9) == 3
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(10)
    assert ms.ValueContext(2, 4).num_replicas_in_sync == 4


def test_per_replica_repr_names_global_replica_ids():
    value = ms.PerReplica((np.float32(6.0),), replica_ids=(3,))
    assert repr(value) == "PerReplica:{\n  3: np.float32(6.0)\n}"
    with pytest.raises(ValueError):
        ms.PerReplica(())


def test_array_kinds_and_gpu_binding():
    import jax.numpy as jnp
    assert array_kind(np.zeros(2)) == "numpy" and array_kind([1, 2]) == "numpy"
    assert array_kind(jnp.zeros(2)) == "jax"
    assert [choose_gpu(r, 2, {}).index for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        choose_gpu(0, 0, {})


def test_backend_choice_by_kind_and_implementation():
    none, both = Capabilities(False, False), Capabilities(True, True)
    auto = ms.CommunicationImplementation.AUTO
    assert select_backend("numpy", auto, both).name == "host-mpi"
    assert select_backend("cupy", auto, none).name == "staged-host-mpi"
    assert select_backend("jax", ms.CommunicationImplementation.MPI, none).name == "staged-host-mpi"
    with pytest.raises(ValueError, match="nccl: CuPy sees no GPU"):
        select_backend("cupy", ms.CommunicationImplementation.NCCL, both)


def test_cuda_awareness_is_asked_of_the_library_not_assumed(monkeypatch):
    aware, reason = cuda_aware_mpi()
    assert isinstance(aware, bool) and reason  # says how it decided
    assert "MPIX_Query_cuda_support" in reason or "Open MPI" in reason or "MPISTRAT" in reason
    cuda_aware_mpi.cache_clear()
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE_MPI", "1")
    assert cuda_aware_mpi() == (True, "MPISTRAT_CUDA_AWARE_MPI=1")
    cuda_aware_mpi.cache_clear()


def test_staged_backend_round_trips_jax_arrays_through_host():
    import jax.numpy as jnp
    engine = ms.MultiWorkerMirroredStrategy().extended.engine
    out = engine.all_reduce({"a": jnp.arange(4.0), "b": np.ones(2)}, "MEAN")
    assert array_kind(out["a"]) == "jax" and array_kind(out["b"]) == "numpy"
    np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(4.0) / engine.size)


def test_wait_all_raises_deadline_exceeded_on_a_request_that_never_completes():
    buffer = np.empty(1)
    request = MPI.COMM_SELF.Irecv(buffer, source=0, tag=99)
    with pytest.raises(ms.errors.DeadlineExceededError, match="timeout_seconds=0.05") as info:
        wait_all([request], Deadline.after(0.05), "test receive")
    assert info.value.pending_requests == [request]
    request.Cancel()
    request.Wait()
    wait_all([MPI.COMM_SELF.Ibarrier()], Deadline.after(5), "barrier")  # completes
    wait_all([MPI.COMM_SELF.Ibarrier()], None, "barrier")


def test_slurm_cluster_resolver_reads_the_step_environment(monkeypatch):
    from mpistrat.cluster_resolver import SlurmClusterResolver
    from mpistrat.runtime import get_world
    for key in ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="srun"):
        SlurmClusterResolver()
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[01-02]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    resolver = SlurmClusterResolver(port_base=9000)
    assert resolver.task_id == 3
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["gpu01:9000", "gpu01:9001", "gpu02:9000", "gpu02:9001"]}
    assert resolver.master() == "mpi://gpu01:9000"
    with pytest.raises(ValueError, match="describes 4 workers"):
        resolver.check_matches_world(get_world())  # this process is one rank, not four
    with pytest.raises(ValueError, match="describes 4 workers"):
        ms.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
