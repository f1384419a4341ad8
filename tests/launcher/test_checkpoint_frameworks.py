"""JAX, optax, Flax NNX, Equinox and Keras 3 state saved at 2 ranks and restored at 1 and 3:
every leaf bit for bit (uint8 views), its type and dtype exactly (bfloat16 JAX arrays
included where the file format stores them)."""

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

JOB = """
import json, os, sys
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np, jax, jax.numpy as jnp, optax, keras, equinox as eqx
from flax import nnx
import mpistrat as ms
from mpistrat.checkpoint.validate import check_dtype
from mpistrat.runtime import get_world

mode, directory = sys.argv[1], sys.argv[2]
try:                             # bfloat16 storage: issue 17's dtype rules (checkpoint/dtypes.py)
    from mpistrat.checkpoint.dtypes import to_stored
    half = jnp.bfloat16
except ImportError:
    try:
        check_dtype(np.dtype(jnp.bfloat16), "probe"); half = jnp.bfloat16
    except Exception:
        half = jnp.float16
keras.utils.set_random_seed(0)

class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 6, rngs=rngs)
        self.bn = nnx.BatchNorm(6, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

def state(seed, train):
    key = jax.random.key(seed)
    params = {"w": jax.random.normal(key, (7, 5)), "half": jnp.linspace(0, 1, 9).astype(half)}
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    net = Net(nnx.Rngs(seed))
    nnx_opt = nnx.Optimizer(net, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=key)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    if train:
        grads = jax.tree.map(jnp.ones_like, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        x = jnp.ones((8, 4))
        nnx_opt.update(net, nnx.grad(lambda m: jnp.mean(m.drop(m.bn(m.l1(x))) ** 2))(net))
        rng = np.random.default_rng(0)
        xs = rng.standard_normal((32, 4)).astype(np.float32)
        model.fit(xs, xs[:, :1], epochs=1, batch_size=8, shuffle=False, verbose=0)
    else:
        params = jax.tree.map(jnp.zeros_like, params)
        opt_state = tx.init(params)
    return {"params": params, "opt_state": opt_state, "hparams": (3, 0.5, True),
            "key": jax.random.key(seed + 1), "net": net, "nnx_opt": nnx_opt, "mlp": mlp,
            "model": model, "optimizer": model.optimizer}

def leaves(s):
    out = {}
    for name in ("params", "opt_state", "hparams", "key"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(s[name])[0]:
            out[name + jax.tree_util.keystr(path)] = leaf
    for name in ("net", "nnx_opt"):
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(s[name]))[0]:
            out[name + jax.tree_util.keystr(path)] = leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(s["mlp"], eqx.is_array))[0]:
        out["mlp" + jax.tree_util.keystr(path)] = leaf
    for i, v in enumerate(s["model"].weights + s["optimizer"].variables):
        out[f"keras/{i}/{v.path}"] = v.value
    return out

def describe(leaf):
    data = leaf
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
        data = jax.random.key_data(leaf)
    array = np.ascontiguousarray(np.asarray(data))
    return (type(leaf).__name__, str(getattr(leaf, "dtype", type(leaf).__name__)),
            array.reshape(-1).view(np.uint8).tobytes().hex())

if mode == "save":
    s = state(0, train=True)
    ckpt = ms.Checkpoint(**s)
    path = ckpt.save(directory + "/ckpt")
    if get_world().rank == 0:
        with open(directory + "/expected.json", "w") as f:
            json.dump({k: describe(v) for k, v in leaves(s).items()}, f)
    say("saved", path, np.dtype(half).name)
else:
    s = state(5, train=False)
    ckpt = ms.Checkpoint(**s)
    status = ckpt.restore(ms.latest_checkpoint(directory))
    s["optimizer"].build(s["model"].trainable_variables)   # the slots appear: restored now
    status.assert_consumed()
    for name in ("params", "opt_state", "hparams", "key", "mlp"):
        s[name] = getattr(ckpt, name)                      # rebuilt and rebound
    expected = json.load(open(directory + "/expected.json"))
    got = {k: describe(v) for k, v in leaves(s).items()}
    bad = sorted(k for k in expected if got.get(k) != tuple(expected[k]))
    say("restored", get_world().size, len(expected), sorted(set(got) ^ set(expected)), bad)
"""


def test_frameworks_saved_at_2_restore_at_1_and_3(launch, tmp_path):
    saved = launch(2, JOB, "save", str(tmp_path), limit=240)
    assert saved.returncode == 0, saved
    assert saved.output.count("saved /") == 2, saved
    for readers in (1, 3):
        restored = launch(readers, JOB, "restore", str(tmp_path), limit=240)
        assert restored.returncode == 0, restored
        lines = [line for line in restored.output.splitlines() if line.startswith("restored")]
        assert len(lines) == readers, restored
        for line in lines:
            assert line.startswith(f"restored {readers} ") and line.endswith(" [] []"), line
