"""The Orbax face of ``ms.CheckpointManager`` at 1-4 ranks: pytrees of JAX and NumPy values
saved at the running width and restored bit for bit (as saved, and into a target tree),
``max_to_keep`` deletions, ``should_save`` rules, ``latest_step``/``all_steps``, and named
errors for missing, foreign and damaged steps. Restores at another width: the launcher test
``tests/launcher/test_orbax_jobs.py``."""

import errno
import json
import os
import typing
import warnings

import h5py
import numpy as np
import pytest

import mpistrat as ms
import mpistrat.checkpoint as ocp
from mpistrat.checkpoint import orbax_manager

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

pytestmark = pytest.mark.numpy_only("builds its own trees of NumPy and JAX values")


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0 picks it)."""
    path = str(tmp_path_factory.mktemp("orbax")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


class Moments(typing.NamedTuple):
    mu: object
    nu: object


def make_tree(seed: int):
    """A training state as a JAX program holds it; the same on every rank."""
    rng = np.random.default_rng(seed)
    return {
        "params": {"dense": {"kernel": jnp.asarray(rng.standard_normal((700, 500), np.float32)),
                             "bias": jnp.asarray(rng.standard_normal(500).astype(
                                 ml_dtypes.bfloat16))},
                   "embed": rng.standard_normal((3, 4))},             # NumPy float64
        "opt_state": (Moments(jnp.zeros(4, jnp.float32), np.full(4, 0.5)), None),
        "step": 1000 + seed,                                          # a Python int
        "lr": 0.001,
        "done": False,
        "counts": np.int64(seed),                                     # a NumPy scalar
        "layers": [jnp.arange(6, dtype=jnp.int32).reshape(2, 3), [np.uint8(7), 2.5], []],
        "rng": jax.random.key(seed),
        3: np.arange(seed, seed + 3, dtype=np.int16),                 # an integer key
    }


def assert_bits(actual, expected, path=""):
    """Every leaf of ``actual`` holds ``expected``'s bits, with its dtype and shape."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for key in expected:
            assert_bits(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)) and not hasattr(expected, "_fields"):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bits(a, e, f"{path}/{i}")
    elif hasattr(expected, "_fields"):               # a NamedTuple comes back as a dict
        assert_bits(actual, dict(expected._asdict()), path)
    elif expected is None or isinstance(expected, (bool, int, float)):
        assert type(actual) is type(expected) and actual == expected, path
    else:
        if isinstance(expected, jax.Array) and jax.dtypes.issubdtype(expected.dtype,
                                                                     jax.dtypes.prng_key):
            expected = jax.random.key_data(expected)   # saved as its key data
        want = np.asarray(expected)
        assert isinstance(actual, (np.ndarray, np.generic)), (path, type(actual))
        assert actual.dtype == want.dtype and actual.shape == want.shape, path
        assert np.asarray(actual).tobytes() == want.tobytes(), path


def assert_typed(actual, expected, path=""):
    """``actual`` has ``expected``'s containers and leaf types (JAX arrays, PRNG keys, NumPy
    arrays and scalars, Python numbers) and holds its bits."""
    assert type(actual) is type(expected) or isinstance(expected, jax.Array) and \
        isinstance(actual, jax.Array), (path, type(actual), type(expected))
    if isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for key in expected:
            assert_typed(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_typed(a, e, f"{path}/{i}")
    elif expected is None or isinstance(expected, (bool, int, float)):
        assert actual == expected, path
    else:
        if isinstance(expected, jax.Array) and jax.dtypes.issubdtype(expected.dtype,
                                                                     jax.dtypes.prng_key):
            assert jax.random.key_impl(actual) == jax.random.key_impl(expected), path
            actual, expected = jax.random.key_data(actual), jax.random.key_data(expected)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), path


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("asynchronous", [True, False])
def test_pytree_round_trip_bit_for_bit(world, shared_dir, asynchronous):
    tree = make_tree(seed=world.size)
    options = ms.CheckpointManagerOptions(enable_async_checkpointing=asynchronous)
    with ms.CheckpointManager(shared_dir, options=options) as mngr:
        assert type(mngr) is ocp.OrbaxCheckpointManager
        assert mngr.save(0, args=ocp.args.StandardSave(tree)) is True
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0] and mngr.latest_step() == 0

        saved = mngr.restore(0)                    # no args: the tree as saved, NumPy
        assert_bits(saved, tree)
        assert isinstance(saved["params"]["dense"]["kernel"], np.ndarray)
        assert isinstance(saved["counts"], np.int64) and isinstance(saved[3], np.ndarray)

        target = make_tree(seed=99)                # same structure, other values
        restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
        kernel = restored["params"]["dense"]["kernel"]
        assert isinstance(kernel, jax.Array)       # JAX arrays stay JAX arrays
        assert kernel.sharding == target["params"]["dense"]["kernel"].sharding
        assert isinstance(restored["opt_state"][0], Moments)
        assert restored["opt_state"][1] is None
        assert_typed(restored, tree)               # the target's types, the saved bits
        assert target["step"] == 1099                # the target itself is untouched

        abstract = {"kernel": jax.ShapeDtypeStruct((700, 500), jnp.float32)}
        part = mngr.restore(0, args=ocp.args.PyTreeRestore(
            {"params": {"dense": abstract}}, partial_restore=True))
        assert isinstance(part["params"]["dense"]["kernel"], np.ndarray)   # no sharding given
        assert part["params"]["dense"]["kernel"].tobytes() == \
            np.asarray(tree["params"]["dense"]["kernel"]).tobytes()
    files = set(os.listdir(os.path.join(shared_dir, "0")))   # (and part files in parts mode)
    assert {"_mpistrat_step.json", "default.h5"} <= files
    assert all(f.startswith("default.part-") for f in files - {"_mpistrat_step.json",
                                                                "default.h5"}), files


@pytest.mark.mpi(min_size=1)
def test_max_to_keep_deletes_the_oldest_steps(world, shared_dir):
    options = ms.CheckpointManagerOptions(max_to_keep=2, keep_period=4)
    mngr = ms.CheckpointManager(shared_dir, options=options)
    for step in range(7):
        assert mngr.save(step, args=ocp.args.StandardSave({"w": np.full(3, step)}))
        assert mngr.all_steps()[-1] == step        # listed at once, even while written
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 4, 5, 6]        # the newest 2, and multiples of keep_period
    world.comm.Barrier()
    assert sorted(os.listdir(shared_dir), key=int) == ["0", "4", "5", "6"]
    again = ms.CheckpointManager(shared_dir)       # what is on disk, complete steps only
    assert again.all_steps() == [0, 4, 5, 6] and again.latest_step() == 6
    assert again.restore(None)["w"].tolist() == [6, 6, 6]
    assert again.restore(4)["w"].tolist() == [4, 4, 4]
    again.delete(5)
    assert again.all_steps() == [0, 4, 6]
    with pytest.raises(FileNotFoundError, match="non-existent step: 5"):
        again.delete(5)
    with pytest.raises(ValueError, match="max_to_keep"):
        ms.CheckpointManagerOptions(max_to_keep=0)


@pytest.mark.mpi(min_size=1)
def test_should_save_follows_orbax_rules(world, shared_dir):
    options = ms.CheckpointManagerOptions(save_interval_steps=3, save_on_steps=[7])
    mngr = ms.CheckpointManager(shared_dir, options=options)
    assert mngr.should_save(1)                     # the first save of an empty directory
    assert [s for s in range(12) if mngr.should_save(s)] == list(range(12))
    assert mngr.save(1, args=ocp.args.StandardSave({"x": 1}))
    assert [s for s in range(12) if mngr.should_save(s)] == [3, 6, 7, 9]
    assert mngr.save(2, args=ocp.args.StandardSave({"x": 2})) is False   # not written
    assert mngr.save(3, args=ocp.args.StandardSave({"x": 3}))
    assert not mngr.should_save(3) and not mngr.should_save(1)   # not after the latest
    assert mngr.save(2, args=ocp.args.StandardSave({"x": 2}), force=True)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2, 3]           # ascending, whatever the order of saves
    with pytest.raises(ocp.StepAlreadyExistsError, match="step 3 already exists"):
        mngr.save(3, args=ocp.args.StandardSave({"x": 3}), force=True)
    reopened = ms.CheckpointManager(shared_dir, options=options)
    assert not reopened.should_save(4) and reopened.should_save(6)   # no first save now
    custom = ms.CheckpointManager(shared_dir, options=ms.CheckpointManagerOptions(
        should_save_fn=lambda step, last: step - last >= 5))
    assert [s for s in range(12) if custom.should_save(s)] == [8, 9, 10, 11]


@pytest.mark.mpi(min_size=1)
def test_latest_step_all_steps_and_missing_steps(world, shared_dir):
    mngr = ms.CheckpointManager(shared_dir)
    assert mngr.latest_step() is None and mngr.all_steps() == []
    with pytest.raises(FileNotFoundError, match="No steps found"):
        mngr.restore(None)
    if world.rank == 0:                            # what a torn save and others leave
        os.makedirs(os.path.join(shared_dir, ".9.tmp-" + "ab" * 16))
        os.makedirs(os.path.join(shared_dir, "8"))          # no manifest: not a step
        os.makedirs(os.path.join(shared_dir, "logs"))
    world.comm.Barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mngr.reload()
    assert mngr.all_steps() == []
    if world.rank == 0:
        assert any("['8']" in str(w.message) for w in caught)
    for step in (10, 20):
        mngr.save(step, args=ocp.args.StandardSave([step]))
    assert mngr.all_steps() == [10, 20] and mngr.latest_step() == 20
    assert mngr.restore(None) == [20] and mngr.restore(10) == [10]
    with pytest.raises(ms.errors.NotFoundError, match="Checkpoint at .*/15 not found"):
        mngr.restore(15)
    assert mngr.all_steps(read=True) == [10, 20]
    world.comm.Barrier()
    assert not any(n.startswith(".9.tmp-") for n in os.listdir(shared_dir))  # cleaned


@pytest.mark.mpi(min_size=1)
def test_foreign_and_damaged_steps_raise_named_errors(world, shared_dir, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CHECKPOINT_MODE", "parallel")   # one file: damaged below
    mngr = ms.CheckpointManager(shared_dir, options=ms.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    for step in (1, 2, 3):
        mngr.save(step, args=ocp.args.StandardSave({"w": np.arange(300_000.0) + step}))
    if world.rank == 0:
        os.makedirs(os.path.join(shared_dir, "5", "default"))       # Orbax's own layout
        with open(os.path.join(shared_dir, "2", "_mpistrat_step.json"), "w") as f:
            f.write('{"format": "mpistrat.orbax-step", "version": 1, "step": 2')
        manifest = os.path.join(shared_dir, "3", "_mpistrat_step.json")
        with open(manifest) as f:
            text = json.load(f)
        text["items"]["default"] = {"t": "dict", "k": [["s", "../x", {"t": "leaf"}]]}
        with open(manifest, "w") as f:
            json.dump(text, f)
        data = os.path.join(shared_dir, "1", "default.h5")
        with h5py.File(data, "r") as f:
            offset = f["w"].id.get_offset()
        with open(data, "r+b") as f:
            f.seek(offset + 8 * 299_990)
            f.write(b"\xff" * 64)                   # the last rows of 'w' damaged
    world.comm.Barrier()
    with pytest.raises(ms.errors.DataLossError, match="written by Orbax itself"):
        mngr.restore(5)
    with pytest.raises(ms.errors.DataLossError, match="not a readable manifest"):
        mngr.restore(2)
    with pytest.raises(ms.errors.DataLossError, match="damaged"):
        mngr.restore(3)
    with pytest.raises(ms.errors.DataLossError, match="checksum"):
        mngr.restore(1)


@pytest.mark.mpi(min_size=1)
def test_targets_and_arguments_that_do_not_fit_are_refused(world, shared_dir):
    mngr = ms.CheckpointManager(shared_dir)
    tree = {"w": np.ones((2, 3), np.float32), "step": 4}
    mngr.save(4, args=ocp.args.StandardSave(tree))
    with pytest.raises(ValueError, match=r"'w'.*float32\[2, 3\].*float32\[3, 2\]"):
        mngr.restore(4, args=ocp.args.StandardRestore({"w": np.ones((3, 2), np.float32),
                                                       "step": 0}))
    widened = mngr.restore(4, args=ocp.args.StandardRestore({"w": tree["w"],
                                                             "step": jnp.int32(0)}))
    assert isinstance(widened["step"], jax.Array) and widened["step"].dtype == jnp.int32
    assert int(widened["step"]) == 4      # a Python int saved, an int32 target: it fits
    mngr.save(5, args=ocp.args.StandardSave({"w": tree["w"], "step": 500}))
    with pytest.raises(ValueError, match="do not fit the target's int8"):
        mngr.restore(5, args=ocp.args.StandardRestore({"w": tree["w"], "step": np.int8(0)}))
    with pytest.raises(ValueError, match="leaves out saved values"):
        mngr.restore(4, args=ocp.args.StandardRestore({"w": tree["w"]}))
    with pytest.raises(ValueError, match="no value for the target's"):
        mngr.restore(4, args=ocp.args.StandardRestore(dict(tree, extra=1.0)))
    with pytest.raises(ValueError, match="Composite"):
        mngr.save(6, args=ocp.args.Composite(a=ocp.args.StandardSave(tree)))
    with pytest.raises(ValueError, match="Must provide `args`"):
        mngr.save(6)
    with pytest.raises(ValueError, match="cannot save 1 value"):
        mngr.save(6, args=ocp.args.StandardSave({"name": "text"}))
    with pytest.raises(NotImplementedError, match="JsonSave"):
        ocp.args.JsonSave({"a": 1})
    with pytest.raises(ocp.OrbaxNotSupportedError, match="best_fn"):
        ms.CheckpointManagerOptions(best_fn=lambda metrics: 0.0)
    with pytest.raises(ocp.OrbaxNotSupportedError, match="strict=False"):
        ocp.args.StandardRestore(tree, strict=False)
    assert mngr.all_steps() == [4, 5]


@pytest.mark.mpi(min_size=1)
def test_composite_items(world, shared_dir):
    mngr = ocp.CheckpointManager(shared_dir, item_names=("state", "extra"))
    state = {"w": jnp.arange(4, dtype=jnp.float32)}
    mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         extra=ocp.args.PyTreeSave([1, 2.5])))
    both = mngr.restore(1)
    assert isinstance(both, ocp.args.Composite) and sorted(both) == ["extra", "state"]
    assert both.extra == [1, 2.5] and both["state"]["w"].tolist() == [0, 1, 2, 3]
    only = mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(state)))
    assert list(only) == ["state"] and isinstance(only.state["w"], jax.Array)
    with pytest.raises(ValueError, match="Must provide `args` of type `Composite`"):
        mngr.save(2, args=ocp.args.StandardSave(state))
    with pytest.raises(ValueError, match="no item 'other'"):
        mngr.restore(1, args=ocp.args.Composite(other=None))
    # items are files: names that a case-folding or normalising file system makes one file
    free = ocp.CheckpointManager(shared_dir + "/free")
    with pytest.raises(ValueError, match="differ only in case"):
        free.save(3, args=ocp.args.Composite(State=ocp.args.StandardSave(state),
                                             state=ocp.args.StandardSave(state)))
    with pytest.raises(ValueError, match="an item is a file"):
        free.save(3, args=ocp.args.Composite(**{"caf\u00e9": ocp.args.StandardSave(state)}))
    assert free.all_steps() == []


@pytest.mark.mpi(min_size=1)
def test_a_failed_asynchronous_save_is_reported_and_changes_nothing(world, shared_dir,
                                                                    monkeypatch):
    mngr = ms.CheckpointManager(shared_dir, options=ms.CheckpointManagerOptions(max_to_keep=1))
    mngr.save(1, args=ocp.args.StandardSave({"w": np.ones(2)}))
    mngr.wait_until_finished()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(orbax_manager, "write_file", full_disk)
    assert mngr.save(2, args=ocp.args.StandardSave({"w": np.zeros(2)}))
    with pytest.raises(OSError) as caught:
        mngr.wait_until_finished()
    assert caught.value.errno == errno.ENOSPC
    assert mngr.all_steps() == [1]                 # step 1 was kept: it is still the latest
    world.comm.Barrier()
    assert sorted(os.listdir(shared_dir)) == ["1"]  # no temporary directory left
    monkeypatch.undo()
    assert mngr.restore(None)["w"].tolist() == [1.0, 1.0]


@pytest.mark.mpi(min_size=1)
def test_tensorflow_call_shape_is_unchanged(world, shared_dir):
    ckpt = ms.Checkpoint(v=ms.Variable(np.zeros(2)))
    manager = ms.CheckpointManager(ckpt, shared_dir, max_to_keep=1)
    assert type(manager) is ms.CheckpointManager
    assert manager.save().endswith("ckpt-1")
    assert type(ms.CheckpointManager(checkpoint=ckpt, directory=shared_dir,
                                     max_to_keep=1)) is ms.CheckpointManager
    with pytest.raises(TypeError, match="options=ms.CheckpointManagerOptions"):
        ms.CheckpointManager(shared_dir, max_to_keep=3)
