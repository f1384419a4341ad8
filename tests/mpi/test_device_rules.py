"""Rules that keep device errors collective: every rank raises together, naming ranks."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.runtime import get_world

pytestmark = pytest.mark.numpy_only("mixes array kinds on purpose")


def test_naming_a_gpu_this_rank_cannot_see_fails_on_every_rank():
    world = get_world()
    if world.num_nodes > 1:
        pytest.skip("MirroredStrategy spans the ranks of one node")
    devices = [f"GPU:{i}" for i in range(world.local_size)]
    with pytest.raises(ValueError, match=r"device binding failed: rank 0: .*GPU:0.*sees 0 GPU"):
        ms.MirroredStrategy(devices=devices)
    # the failed attempt left the binding usable: host replicas, as before
    assert ms.MirroredStrategy().extended.worker_devices[0].endswith("CPU:0")


def test_ranks_passing_different_array_kinds_get_an_error_not_a_hang():
    jnp = pytest.importorskip("jax.numpy")
    world = get_world()
    if world.size == 1:
        pytest.skip("needs two ranks")
    engine = ms.MultiWorkerMirroredStrategy().extended.engine
    value = jnp.ones(300, jnp.float32) if world.rank == 0 else np.ones(300, np.float32)
    with pytest.raises(ms.errors.InvalidArgumentError, match="rank"):
        engine.all_reduce(value, "SUM")
    assert engine.all_reduce(np.ones(3), "SUM").tolist() == [world.size] * 3  # still usable
    # a small SUM rides in the validation probe from the host whatever the kind: it meets
    small = jnp.ones(3, jnp.float32) if world.rank == 0 else np.ones(3, np.float32)
    total = engine.all_reduce(small, "SUM")
    assert type(total) is type(small) and np.asarray(total).tolist() == [world.size] * 3
