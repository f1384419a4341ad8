"""The parts of the JAX bridge that need neither MPI peers nor a started JAX."""

import socket

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.distribute.reduction import combine_local as _combine_local, mean as _mean
from mpistrat.runtime import jax_bridge


def test_importing_mpistrat_does_not_start_jax():
    assert not jax_bridge.is_initialized()


def test_coordinator_address_is_a_free_port_or_what_the_user_set(monkeypatch):
    monkeypatch.delenv("MPISTRAT_JAX_COORDINATOR", raising=False)
    monkeypatch.setenv("MPISTRAT_COORDINATOR_HOST", "127.0.0.1")
    host, port = jax_bridge.coordinator_address().rsplit(":", 1)
    assert host == "127.0.0.1"
    with socket.socket() as probe:      # the port is free to bind
        probe.bind(("127.0.0.1", int(port)))
    monkeypatch.setenv("MPISTRAT_JAX_COORDINATOR", "node7:4242")
    assert jax_bridge.coordinator_address() == "node7:4242"


def test_topology_counts_replicas():
    topology = jax_bridge.Topology(num_tasks=3, num_devices_per_task=4, platform="tpu",
                                   device_kind="TPU v4")
    assert topology.num_replicas == 12


def test_tpu_cluster_resolver_takes_its_hosts_from_mpi():
    resolver = ms.cluster_resolver.TPUClusterResolver(tpu="")
    assert resolver.task_id == 0 and resolver.environment == "jax"
    assert resolver.cluster_spec().num_tasks("worker") == 1
    assert resolver.master().startswith("mpi://")
    for name in ("my-tpu", "grpc://10.1.2.3:8470"):
        with pytest.raises(ValueError, match="mpirun or srun"):
            ms.cluster_resolver.TPUClusterResolver(tpu=name)


def test_unsupported_tpu_helpers_raise_not_implemented():
    with pytest.raises(NotImplementedError, match="one-axis mesh"):
        ms.tpu.experimental.DeviceAssignment()
    with pytest.raises(NotImplementedError, match="device_assignment"):
        ms.TPUStrategy(device_assignment="anything")


def test_local_replicas_combine_before_crossing_ranks():
    parts = [np.array([1, -3]), np.array([2, -4])]
    assert _combine_local(ms.ReduceOp.SUM, parts, (0, 1)).tolist() == [3, -7]
    assert _combine_local(ms.ReduceOp.MIN, parts, (0, 1)).tolist() == [1, -4]
    with pytest.raises(ValueError, match="replica 5: \\[3\\]"):
        _combine_local(ms.ReduceOp.SUM, [np.zeros(2), np.zeros(3)], (4, 5))
    assert _mean(np.array([7, -7]), 2).tolist() == [3, -3]   # truncates toward zero, as TF
    assert _mean(np.array([7.0]), 2).tolist() == [3.5]


def test_adjacent_row_blocks_are_joined_without_a_copy():
    batch = np.arange(48, dtype=np.float32).reshape(12, 4)
    parts = np.split(batch, 4)
    joined = jax_bridge._adjacent_rows(parts)
    assert np.shares_memory(joined, batch) and np.array_equal(joined, batch)
    assert jax_bridge._adjacent_rows(parts[::-1]) is None            # out of order
    assert jax_bridge._adjacent_rows([p.copy() for p in parts]) is None  # separate memory
    middle = np.split(batch[2:10], 2)
    np.testing.assert_array_equal(jax_bridge._adjacent_rows(middle), batch[2:10])
