"""Checkpoints of values of the run's array kind (``arrays``, MPISTRAT_TEST_ARRAYS): variables
and arrays in containers saved at this width, restored bit for bit and of the same kind."""

import numpy as np
import pytest

import mpistrat as ms


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kinds")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def values(seed):
    rng = np.random.default_rng(seed)
    return {"kernel": rng.standard_normal((300, 7)), "steps": rng.integers(0, 9, 5).astype(np.int32),
            "half": rng.standard_normal(4).astype(np.float16)}


@pytest.mark.mpi(min_size=1)
def test_variables_and_containers_of_the_kind_round_trip(strategy, world, shared_dir, arrays):
    want = values(seed=3)
    with strategy.scope():
        model = {k: ms.Variable(arrays.asarray(v)) for k, v in want.items()}
    tree = arrays.tree(values(seed=4))
    path = ms.Checkpoint(model=model, tree=tree).save(shared_dir + "/ckpt")
    for k, v in want.items():
        model[k].assign(arrays.xp.zeros(v.shape, v.dtype))
    fresh = arrays.tree({k: np.zeros_like(v) for k, v in values(seed=4).items()})
    ms.Checkpoint(model=model, tree=fresh).restore(path).assert_consumed()
    for k, v in want.items():
        assert model[k].numpy().tobytes() == v.tobytes(), k
        assert model[k].numpy().dtype == v.dtype
    for k, v in values(seed=4).items():     # in place, or rebuilt and rebound (JAX)
        assert arrays.numpy(fresh[k]).tobytes() == v.tobytes(), k
    arrays.assert_kind(fresh)
