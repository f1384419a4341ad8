"""ms.nn across ranks: TensorFlow's loss scaling inside strategy.run, and the optax transformation
that aggregates gradients inside the update (issue 16). Each replica trains on its own rows of one
global batch; the parameters stay identical on every rank and equal those of one process training
on the whole global batch."""

import numpy as np
import pytest

import mpistrat as ms

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

GLOBAL = 12          # rows per global batch (divisible by 1, 2, 3 and 4 ranks)


def _data(steps=4):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(steps, GLOBAL, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    return x, y


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _rows(world):
    per = GLOBAL // world.size
    return slice(world.rank * per, (world.rank + 1) * per)


def _train(tx, x, y, rows, jit):
    params = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    state = tx.init(params)

    def step(params, state, xb, yb):
        grads = jax.grad(_loss)(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    for xb, yb in zip(x, y):
        params, state = step(params, state, xb[rows], yb[rows])
    return jax.tree.map(np.asarray, params)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_aggregated_adam_matches_one_process_on_the_global_batch(world, strategy, jit):
    x, y = _data()
    tx = optax.chain(ms.nn.aggregate_gradients(strategy), optax.adam(0.1))
    mine = _train(tx, x, y, _rows(world), jit)
    reference = _train(optax.adam(0.1), x, y, slice(None), jit)   # one process, global batch
    for name in mine:
        gathered = world.comm.allgather(mine[name].tobytes())
        assert len(set(gathered)) == 1, f"{name} differs between ranks"   # bit for bit
        assert mine[name].dtype == np.float32
        np.testing.assert_allclose(mine[name], reference[name], rtol=2e-5, atol=2e-6)
    assert world.size == 1 or not np.allclose(
        _train(optax.adam(0.1), x, y, _rows(world), jit)["w"], reference["w"], atol=1e-3)


@pytest.mark.mpi(min_size=1)
def test_sum_of_compute_average_loss_gradients_is_the_global_mean(world, strategy):
    x, y = _data(steps=1)

    def loss(params, xb, yb):
        per_example = (xb @ params["w"] + params["b"] - yb) ** 2
        return ms.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)

    tx = optax.chain(ms.nn.aggregate_gradients(strategy, "SUM",
                                               ms.CommunicationOptions(deterministic=True)),
                     optax.sgd(0.05))
    params = {"w": jnp.ones(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    grads = jax.grad(loss)(params, x[0][_rows(world)], y[0][_rows(world)])
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    want = jax.grad(_loss)(params, x[0], y[0])
    np.testing.assert_allclose(np.asarray(updates["w"]), -0.05 * np.asarray(want["w"]),
                               rtol=2e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_compute_average_loss_in_run_defaults_to_rows_times_replicas(world, strategy):
    def replica_loss():
        per_example = np.full(3, float(world.rank + 1), np.float32)
        return (ms.nn.compute_average_loss(per_example),
                ms.nn.scale_regularization_loss(np.float32(2.0)))

    loss, reg = strategy.run(replica_loss)
    n = world.size
    assert loss == pytest.approx(3 * (world.rank + 1) / (3 * n)) and loss.dtype == np.float32
    total = strategy.reduce("SUM", loss, axis=None)
    assert float(total) == pytest.approx(sum(range(1, n + 1)) / n)   # the global mean
    assert float(strategy.reduce("SUM", reg, axis=None)) == pytest.approx(2.0)


@pytest.mark.mpi(min_size=2)
def test_aggregate_gradients_without_a_strategy_is_refused(world):
    with pytest.raises(ValueError, match=f"runs {world.size} ranks; pass the strategy"):
        ms.nn.aggregate_gradients()


@pytest.mark.mpi(min_size=1)
def test_flax_nnx_state_gradients_are_summed_inside_nnx_jit(world, strategy):
    nnx = pytest.importorskip("flax.nnx")
    x, y = _data(steps=3)

    def train(rows, aggregate):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, xb, yb):
            def loss_fn(model):
                per_example = (model(xb)[:, 0] - yb) ** 2
                return ms.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)
            grads = nnx.grad(loss_fn)(model)
            if aggregate:
                grads = ms.nn.all_reduce_gradients(grads, strategy, "SUM")
            optimizer.update(model, grads)

        for xb, yb in zip(x, y):
            step(model, optimizer, jnp.asarray(xb[rows]), jnp.asarray(yb[rows]))
        return np.asarray(model.kernel[...])

    mine = train(_rows(world), aggregate=True)
    assert len(set(world.comm.allgather(mine.tobytes()))) == 1
    np.testing.assert_allclose(mine, train(slice(None), aggregate=False), rtol=2e-5, atol=2e-6)
