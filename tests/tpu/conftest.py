"""Fixtures for the TPUStrategy tests: run under mpirun at 1 and 2 ranks, each rank a
JAX host with 4 virtual CPU devices (``scripts/test.sh`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4``)."""

import os

import pytest

import mpistrat as ms
from mpistrat.runtime import get_world

# 4 virtual CPU devices per rank here; a GPU host run sets this to its device count.
DEVICES_PER_HOST = int(os.environ.get("MPISTRAT_TEST_DEVICES_PER_HOST", "4"))


@pytest.fixture(scope="session")
def world():
    return get_world()


@pytest.fixture(scope="session")
def strategy():
    """The upstream initialisation, once per process (JAX starts once)."""
    resolver = ms.cluster_resolver.TPUClusterResolver(tpu='')
    ms.config.experimental_connect_to_cluster(resolver)
    ms.tpu.experimental.initialize_tpu_system(resolver)
    return ms.TPUStrategy(resolver)


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0 picks it)."""
    path = str(tmp_path_factory.mktemp("tpu")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)
