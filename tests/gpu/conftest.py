"""GPU tests: CuPy values through strategies, NCCL / staged / hierarchical backends.

They need CuPy and a CUDA GPU; elsewhere every test is skipped with the
reason. ``scripts/gpu_check.sh`` runs them at 1 rank (NCCL), 2 ranks sharing
one GPU (staged) and 2 simulated nodes x 1 rank (hierarchical).
"""

import os
import tempfile

import pytest

from mpistrat.runtime.devices import cupy_available

SKIP_REASON = ("GPU test: needs CuPy and a CUDA GPU (CuPy is not installed or sees no GPU on "
               "this machine); run scripts/gpu_check.sh PYTHON on a GPU machine")


def pytest_collection_modifyitems(config, items):
    if cupy_available():
        return
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture
def world():
    from mpistrat.runtime import get_world
    return get_world()


@pytest.fixture(scope="module")
def strategy():
    import mpistrat as ms
    return ms.MultiWorkerMirroredStrategy()


@pytest.fixture
def shared_dir():
    """A directory every rank sees (rank 0 makes it; ranks share one machine here)."""
    from mpistrat.runtime import get_world
    world = get_world()
    path = tempfile.mkdtemp(prefix="mpistrat-gpu-") if world.rank == 0 else None
    return world.comm.bcast(path, root=0)
