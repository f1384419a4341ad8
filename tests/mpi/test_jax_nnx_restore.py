"""A Flax NNX model and its ``nnx.Optimizer`` restore whole or not at all (issue 44): a
checkpoint of another structure (another optax transformation, another model width or depth)
is a ``ValueError`` on every rank naming the object and what differs on both sides, raised
before anything is read, so nothing of the model or the optimizer changes. Checkpoints that
hold some objects and not others keep TensorFlow's partial rules."""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms

jax = pytest.importorskip("jax")
jnp = jax.numpy
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
    "framework state runs at 1-3 ranks, as tests/mpi/test_checkpoint_frameworks.py"))


class Net(nnx.Module):
    def __init__(self, width: int, depth: int, rngs):
        self.layers = nnx.List([nnx.Linear(3 if i == 0 else width, width, rngs=rngs)
                                for i in range(depth)])
        self.out = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.out(x)


def trained(tx, width=8, depth=1, seed=0):
    """A model and optimizer after one step (every slot non-trivial), alike on every rank."""
    model = Net(width, depth, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean(m(jnp.ones((4, 3))) ** 2))(model)
    optimizer.update(model, grads)
    return model, optimizer


def snapshot(*objects):
    return [np.asarray(leaf).tobytes() for obj in objects
            for leaf in jax.tree.leaves(nnx.state(obj))]


@pytest.fixture
def saved(world, tmp_path_factory):
    """A checkpoint of an adam-trained Net(width 8, depth 1), and of its model alone."""
    directory = str(tmp_path_factory.mktemp("nnx")) if world.rank == 0 else None
    directory = world.comm.bcast(directory, root=0)
    model, optimizer = trained(optax.adam(1e-2))
    full = ms.Checkpoint(model=model, optimizer=optimizer).save(directory + "/full")
    alone = ms.Checkpoint(model=model).save(directory + "/alone")
    return model, optimizer, full, alone


def refused(path, model, optimizer, *patterns):
    """Restoring ``path`` raises naming each pattern, and leaves both objects as they were."""
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError) as caught:
        ms.Checkpoint(model=model, optimizer=optimizer).restore(path)
    for pattern in patterns:
        assert pattern in str(caught.value), (pattern, str(caught.value))
    assert snapshot(model, optimizer) == before     # nothing was restored
    return str(caught.value)


@pytest.mark.mpi(min_size=1)
def test_another_optimizer_is_refused_naming_both_states(world, saved):
    _, _, full, _ = saved
    model, optimizer = trained(optax.sgd(0.1, momentum=0.9), seed=5)
    text = refused(full, model, optimizer, "'optimizer' (flax.nnx",
                   "only in the checkpoint: opt_state/0/count int32[], opt_state/0/mu/",
                   "only in the object: opt_state/0/trace/layers/0/bias float32[8]",
                   "the same optax transformation")
    assert "rank 0: ValueError" in text        # agreed: every rank raises the same error


@pytest.mark.mpi(min_size=1)
def test_an_optimizer_sharing_some_slots_is_refused_not_half_restored(world, saved):
    _, _, full, _ = saved            # Lion's state holds count and mu, as adam's does
    model, optimizer = trained(optax.lion(1e-3), seed=5)
    refused(full, model, optimizer, "only in the checkpoint: opt_state/0/nu/layers/0/bias")


@pytest.mark.mpi(min_size=1)
def test_another_width_or_depth_is_refused_naming_the_shapes(world, saved):
    _, _, full, _ = saved
    model, optimizer = trained(optax.adam(1e-2), width=16, seed=5)
    refused(full, model, optimizer, "'model' (", "layers/0/kernel (checkpoint float32[3, 8], "
            "object float32[3, 16])", "opt_state/0/mu/out/kernel (checkpoint float32[8, 2], "
            "object float32[16, 2])")
    model, optimizer = trained(optax.adam(1e-2), depth=2, seed=5)
    refused(full, model, optimizer, "only in the object: layers/1/bias float32[8], "
            "layers/1/kernel float32[8, 8]", "opt_state/0/nu/layers/1/kernel")


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_another_optimizer_makes_every_rank_raise(world, saved):
    _, _, full, _ = saved
    tx = optax.sgd(0.1, momentum=0.9) if world.rank == world.size - 1 else optax.adam(1e-2)
    model, optimizer = trained(tx, seed=5)
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError, match=f"rank {world.size - 1}: ValueError: .*'optimizer'"):
        ms.Checkpoint(model=model, optimizer=optimizer).restore(full)
    assert snapshot(model, optimizer) == before


@pytest.mark.mpi(min_size=1)
def test_same_structure_and_partial_checkpoints_still_restore(world, saved):
    model, optimizer, full, alone = saved
    other, other_opt = trained(optax.adamw(1e-2), seed=5)   # adamw keeps adam's state
    ms.Checkpoint(model=other, optimizer=other_opt).restore(full).assert_consumed()
    assert snapshot(other, other_opt) == snapshot(model, optimizer)
    # a model-only checkpoint beside an optimizer of any kind: the model comes back
    fresh, fresh_opt = trained(optax.sgd(0.1, momentum=0.9), seed=5)
    status = ms.Checkpoint(model=fresh, optimizer=fresh_opt).restore(alone)
    assert snapshot(fresh) == snapshot(model)
    with pytest.raises(AssertionError, match="optimizer/opt_state/0/trace"):
        status.assert_existing_objects_matched()
    # the model alone from the full checkpoint, the optimizer's values left over
    lone, _ = trained(optax.sgd(0.1), seed=5)
    ms.Checkpoint(model=lone).restore(full).expect_partial()
    assert snapshot(lone) == snapshot(model)


@pytest.mark.mpi(min_size=1)
def test_an_optimizer_attached_after_the_restore_is_checked_whole(world, saved):
    model, optimizer, full, _ = saved
    fresh, wrong = trained(optax.sgd(0.1, momentum=0.9), seed=5)
    checkpoint = ms.Checkpoint(model=fresh)
    checkpoint.restore(full)
    before = snapshot(wrong)
    with pytest.raises(ValueError, match="'optimizer' .*only in the object: opt_state/0/trace"):
        checkpoint.optimizer = wrong
    assert snapshot(wrong) == before
    right_model, right = trained(optax.adam(1e-2), seed=5)
    checkpoint = ms.Checkpoint(model=right_model)
    checkpoint.restore(full).expect_partial()
    checkpoint.optimizer = right
    assert snapshot(right) == snapshot(optimizer)
