"""Fixtures for the multi-rank tests (run under mpirun with --with-mpi)."""

import pytest

import mpistrat as ms
from mpistrat.runtime import get_world


@pytest.fixture
def world():
    return get_world()


@pytest.fixture
def strategy():
    return ms.MultiWorkerMirroredStrategy()
