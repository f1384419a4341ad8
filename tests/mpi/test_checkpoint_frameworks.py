"""Checkpoints of the state JAX programs bring, at this width: JAX pytrees (optax states,
flax.struct dataclasses, custom nodes, tuples of numbers), Flax NNX, Equinox and Keras 3.
Saved and restored in the same run, compared leaf by leaf bit for bit (uint8 views), with
types, dtypes, treedefs and devices exact; refusals and ``assert_consumed`` failures named;
values of objects created after the restore (lazily built layers, optimizer slots) applied
when those objects appear. Width changes: tests/launcher/test_checkpoint_frameworks.py."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

import mpistrat as ms  # noqa: E402
from mpistrat.checkpoint.validate import check_dtype  # noqa: E402

pytestmark = [pytest.mark.numpy_only("JAX, Keras and NNX values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "framework state runs at 1-3 ranks (widths 1, 2 and an odd one); at 4 the same "
                  "engine paths run in the other suites, and make test must stay under 30 min"))]


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("frameworks")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def raw(leaf) -> np.ndarray:
    """A leaf's bytes (PRNG keys as their key data)."""
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8)


def assert_same_tree(actual, expected):
    """Same treedef, and every leaf of the same type and dtype, bit for bit, on the same
    devices."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert type(a) is type(e), (type(a), type(e))
        if hasattr(e, "dtype"):
            assert a.dtype == e.dtype, (a.dtype, e.dtype)
            assert np.array_equal(raw(a), raw(e))
        else:
            assert a == e
        if isinstance(e, jax.Array):
            assert a.devices() == e.devices()


def params_of(seed, dtype=jnp.float32):
    key = jax.random.key(seed)
    return {"dense": {"kernel": jax.random.normal(key, (5, 3), dtype),
                      "bias": jnp.arange(3, dtype=dtype)}}


@pytest.mark.mpi(min_size=1)
def test_jax_pytrees_optax_states_and_numbers_round_trip(world, shared_dir):
    from flax import struct

    @struct.dataclass
    class TrainState:
        step: jax.Array
        scale: float
        name: str = struct.field(pytree_node=False, default="run")

    params = params_of(1)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = tx.update(grads, opt_state, params)   # non-trivial mu, nu, count
    params = optax.apply_updates(params, updates)
    frozen = np.arange(6.0).reshape(2, 3)
    frozen.flags.writeable = False
    want = {"params": params, "opt_state": opt_state, "hparams": (3, 0.5, True),
            "state": TrainState(jnp.int32(7), 0.25), "frozen": frozen,
            "key": jax.random.key(11), "steps": jnp.arange(4, dtype=jnp.int32), "host": jax.tree.map(np.asarray, params)}
    for name in ("host",):
        for leaf in jax.tree.leaves(want[name]):
            leaf.flags.writeable = False                    # what jax.tree.map(np.asarray) gives
    path = ms.Checkpoint(**want).save(shared_dir + "/ckpt")
    zeros = {"params": jax.tree.map(jnp.zeros_like, params),
             "opt_state": tx.init(jax.tree.map(jnp.zeros_like, params)),
             "hparams": (0, 0.0, False), "state": TrainState(jnp.int32(0), 0.0),
             "frozen": np.zeros((2, 3)), "key": jax.random.key(0), "steps": jnp.zeros(4, jnp.int32),
             "host": jax.tree.map(lambda x: np.asarray(jnp.zeros_like(x)), params)}
    for leaf in jax.tree.leaves(zeros["host"]):
        leaf.flags.writeable = False
    fresh = ms.Checkpoint(**zeros)
    fresh.restore(path).assert_consumed().assert_nontrivial_match()
    for name, value in want.items():
        assert_same_tree(getattr(fresh, name), value)
    assert fresh.hparams == (3, 0.5, True) and type(fresh.hparams[0]) is int
    assert fresh.state.name == "run" and type(fresh.state) is TrainState
    assert type(fresh.opt_state[1][0]).__name__ == "ScaleByAdamState"


@pytest.mark.mpi(min_size=1)
def test_flax_train_state_step_comes_back_as_the_jax_array_it_was_saved_as(world, shared_dir):
    train_state = pytest.importorskip("flax.training.train_state")
    params, tx = params_of(3), optax.sgd(0.1)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.replace(step=jnp.asarray(41, jnp.int32) + 1)     # as a jitted step leaves it
    path = ms.Checkpoint(state=state, epoch=np.int16(3), seen=7).save(shared_dir + "/flax")
    fresh = ms.Checkpoint(state=train_state.TrainState.create(apply_fn=None, params=params,
                                                                tx=tx), epoch=0, seen=0)
    assert type(fresh.state.step) is int                   # what TrainState.create holds
    fresh.restore(path).assert_consumed()
    step = fresh.state.step
    assert isinstance(step, jax.Array) and step.dtype == jnp.int32 and int(step) == 42
    assert type(fresh.epoch) is np.int16 and fresh.epoch == 3   # a NumPy scalar stays one
    assert type(fresh.seen) is int and fresh.seen == 7           # a Python int stays one


@pytest.mark.mpi(min_size=1)
def test_bfloat16_jax_arrays_round_trip(world, shared_dir):
    params = params_of(2, jnp.bfloat16)
    path = ms.Checkpoint(params=params).save(shared_dir + "/bf16")
    fresh = ms.Checkpoint(params=jax.tree.map(jnp.zeros_like, params))
    fresh.restore(path).assert_consumed()
    assert_same_tree(fresh.params, params)


class Registered:
    """A custom pytree node with no keys: children named by position."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(Registered, lambda r: ((r.a, r.b), None),
                                   lambda _, c: Registered(*c))


@pytest.mark.mpi(min_size=1)
def test_custom_nodes_nested_in_objects_are_rebuilt_on_their_parent(world, shared_dir):
    class Holder:
        def __init__(self, node):
            self.node = node
            self.activation = jax.nn.relu        # code held as an attribute: skipped
    holder = Holder(Registered(jnp.ones(3), (jnp.int32(2), 1.5)))
    path = ms.Checkpoint(holder=holder).save(shared_dir + "/custom")
    fresh = Holder(Registered(jnp.zeros(3), (jnp.int32(0), 0.0)))
    ms.Checkpoint(holder=fresh).restore(path).assert_consumed()
    assert type(fresh.node) is Registered
    assert_same_tree((fresh.node.a, fresh.node.b), (holder.node.a, holder.node.b))


@pytest.mark.mpi(min_size=1)
def test_values_that_cannot_be_saved_are_refused_naming_each_path(world, shared_dir):
    class Opaque:
        __slots__ = ()

    class Config:
        def __init__(self):
            self.name, self.comment = "run", None
    ckpt = ms.Checkpoint(params=params_of(3), fn=lambda x: x, gen=(i for i in range(3)),
                         nested={"ok": 1.0, "opaque": Opaque(), "config": Config()})
    with pytest.raises(ValueError) as info:
        ckpt.save(shared_dir + "/bad")
    text = str(info.value)
    for name in ("'fn'", "'gen'", "'nested/opaque'", "'nested/config'"):
        assert name in text, text
    assert "'params" not in text and "'nested/ok'" not in text
    assert ms.latest_checkpoint(shared_dir) is None and int(ckpt.save_counter) == 0
    one_rank = {"w": np.ones(2)} if world.rank else {"w": np.ones(2), "f": print}
    with pytest.raises(ValueError, match=r"rank 0: .*'extra/f'"):   # every rank raises
        ms.Checkpoint(extra=one_rank).save(shared_dir + "/one")


@pytest.mark.mpi(min_size=1)
def test_assert_consumed_names_values_and_objects_left_over(world, shared_dir):
    params = params_of(4)
    opt_state = optax.adam(1e-3).init(params)
    path = ms.Checkpoint(params=params, opt_state=opt_state).save(shared_dir + "/ckpt")
    only_params = ms.Checkpoint(params=jax.tree.map(jnp.zeros_like, params))
    status = only_params.restore(path)
    with pytest.raises(AssertionError, match=r"opt_state/0/mu/dense/kernel"):
        status.assert_consumed()
    status.assert_existing_objects_matched()
    extra = ms.Checkpoint(params=jax.tree.map(jnp.zeros_like, params),
                          opt_state=optax.adam(1e-3).init(params), ema=jnp.zeros(2))
    status = extra.restore(path)
    with pytest.raises(AssertionError, match=r"'ema'"):
        status.assert_consumed()
    with pytest.raises(AssertionError, match=r"'ema'"):
        status.assert_existing_objects_matched()


@pytest.mark.mpi(min_size=1)
def test_flax_nnx_module_and_optimizer(world, shared_dir):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(self.bn(nnx.relu(self.l1(x)))))

    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step(model, optimizer, x)
    path = ms.Checkpoint(model=model, optimizer=optimizer).save(shared_dir + "/nnx")
    other = Net(nnx.Rngs(7))
    other_opt = nnx.Optimizer(other, optax.adam(1e-2), wrt=nnx.Param)
    ms.Checkpoint(model=other, optimizer=other_opt).restore(path).assert_consumed()
    assert_same_tree(nnx.state(other), nnx.state(model))
    assert_same_tree(nnx.state(other_opt), nnx.state(optimizer))
    step(model, optimizer, x)      # training continues identically (dropout keys included)
    step(other, other_opt, x)
    assert_same_tree(nnx.state(other), nnx.state(model))
    path = ms.Checkpoint(state=nnx.state(model, nnx.Param)).save(shared_dir + "/state")
    third = Net(nnx.Rngs(9))
    ms.Checkpoint(state=nnx.state(third, nnx.Param)).restore(path).assert_consumed()
    assert_same_tree(nnx.state(third, nnx.Param), nnx.state(model, nnx.Param))  # in the module


@pytest.mark.mpi(min_size=1)
def test_equinox_module_is_rebuilt(world, shared_dir):
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    path = ms.Checkpoint(mlp=mlp).save(shared_dir + "/eqx")
    holder = ms.Checkpoint(mlp=eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(1)))
    holder.restore(path).assert_consumed()
    assert type(holder.mlp) is type(mlp)
    assert_same_tree(eqx.filter(holder.mlp, eqx.is_array), eqx.filter(mlp, eqx.is_array))


def keras_model(keras):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.2),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def keras_variables(model):
    return [np.asarray(v.value) for v in model.weights + model.optimizer.variables]


@pytest.mark.mpi(min_size=1)
def test_keras_model_and_optimizer_resume_bit_identical(world, shared_dir):
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x[:, :2] * 2).astype(np.float32)
    model = keras_model(keras)
    model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    path = ms.Checkpoint(model=model, optimizer=model.optimizer).save(shared_dir + "/keras")
    fresh = keras_model(keras)                # optimizer slots do not exist yet
    status = ms.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    assert any(p.startswith("optimizer/momentums/") for p in status.unmatched_values)
    for a, b in zip(fresh.weights, model.weights):
        assert np.array_equal(raw(a.value), raw(b.value)), a.path
    assert fresh.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    fresh.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)  # slots built: restored
    status.assert_consumed()
    for a, b in zip(keras_variables(fresh), keras_variables(model)):
        assert a.dtype == b.dtype and np.array_equal(raw(a), raw(b))


@pytest.mark.mpi(min_size=1)
def test_restore_on_create_at_any_depth(world, shared_dir):
    keras = pytest.importorskip("keras")

    class Trainer:
        def __init__(self):
            self.net = {"encoder": keras.Sequential([keras.layers.Dense(3),
                                                     keras.layers.Dense(1)])}
            self.opt_state = ()

    source = Trainer()
    source.net["encoder"](np.ones((2, 5), np.float32))
    params = params_of(5)
    source.opt_state = optax.sgd(0.1, momentum=0.9).init(params)
    head = keras.Sequential([keras.layers.Dense(2)])
    head(np.ones((1, 3), np.float32))
    path = ms.Checkpoint(trainer=source, head=head).save(shared_dir + "/lazy")
    target = Trainer()                           # nothing built, no optimizer state yet
    ckpt = ms.Checkpoint(trainer=target)
    status = ckpt.restore(path)
    assert "trainer/net/encoder/layer-0/kernel" in status.unmatched_values
    target.net["encoder"](np.ones((2, 5), np.float32))   # built at its first call: restored
    for a, b in zip(target.net["encoder"].weights, source.net["encoder"].weights):
        assert np.array_equal(raw(a.value), raw(b.value))
    target.opt_state = optax.sgd(0.1, momentum=0.9).init(jax.tree.map(jnp.zeros_like, params))
    status.apply_pending()                       # a pytree attached deep inside: on request
    assert_same_tree(target.opt_state, source.opt_state)
    ckpt.head = keras.Sequential([keras.layers.Dense(2)])   # attached unbuilt, after the restore
    ckpt.head(np.ones((1, 3), np.float32))
    for a, b in zip(ckpt.head.weights, head.weights):
        assert np.array_equal(raw(a.value), raw(b.value))
    status.assert_consumed()


@pytest.mark.mpi(min_size=1)
def test_a_jax_array_held_twice_is_restored_at_both_holders(world, shared_dir):
    tied = jnp.arange(4.0)                       # tied weights: one immutable array, two holders
    path = ms.Checkpoint(encoder={"emb": tied}, decoder={"emb": tied}).save(shared_dir + "/t")
    zeros = jnp.zeros(4)
    fresh = ms.Checkpoint(encoder={"emb": zeros}, decoder={"emb": zeros})
    fresh.restore(path).assert_consumed()
    assert_same_tree(fresh.encoder, {"emb": tied})
    assert_same_tree(fresh.decoder, {"emb": tied})


@pytest.mark.mpi(min_size=1)
def test_a_layer_inserted_before_resuming_is_reported_not_silent(world, shared_dir):
    """A Dropout inserted before the second Dense shifts the positional paths: the second
    Dense got no value and kept its fresh weights while restore_or_initialize said nothing.
    Now it warns naming the objects left at their initial values, and
    assert_existing_objects_matched names them too."""
    keras = pytest.importorskip("keras")

    def build(dropout):
        keras.utils.set_random_seed(7)
        layers = [keras.layers.Dense(5), keras.layers.Dense(2)]
        if dropout:
            layers.insert(1, keras.layers.Dropout(0.2))
        return keras.Sequential([keras.Input((4,))] + layers)

    directory = os.path.join(shared_dir, "inserted")
    manager = ms.CheckpointManager(ms.Checkpoint(model=build(False)), directory, max_to_keep=1)
    manager.save()
    changed = build(True)
    resumed = ms.CheckpointManager(ms.Checkpoint(model=changed), directory, max_to_keep=1)
    if world.rank == 0:
        with pytest.warns(UserWarning, match="keep their initial values") as caught:
            assert resumed.restore_or_initialize() is not None
        text = " ".join(str(w.message) for w in caught if "keep their initial" in str(w.message))
        assert "model/layer-2/kernel" in text or "layer-2" in text, text
    else:
        assert resumed.restore_or_initialize() is not None
    status = ms.Checkpoint(model=changed).restore(manager.latest_checkpoint)
    with pytest.raises(AssertionError, match="objects without a value"):
        status.assert_existing_objects_matched()
