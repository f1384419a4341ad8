"""mpistrat.horovod: Horovod's API for programs written for horovod.tensorflow.keras. The
collectives agree with MPI's; DistributedOptimizer + fit trains each rank on its own rows and
gives the weights of one process training on the union of the ranks' batches (rtol 1e-5);
BroadcastGlobalVariablesCallback takes the root's values; ranks with different numbers of
batches raise on every rank (Horovod hangs there); the warm-up follows Horovod's formula."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

import mpistrat as ms  # noqa: E402
import mpistrat.horovod as hvd  # noqa: E402

pytestmark = [pytest.mark.numpy_only("Keras and NumPy values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "Horovod programs run at 1-3 ranks; at 4 the same engine paths run in the "
                  "other suites"))]

BATCH = 8


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


def test_ranks_sizes_and_collectives_agree_with_mpi(world):
    n, r = world.size, world.rank
    assert (hvd.rank(), hvd.size()) == (r, n) and hvd.is_initialized()
    assert hvd.local_rank() == world.local_rank and hvd.local_size() == world.local_size
    assert hvd.cross_size() == world.num_nodes and hvd.cross_rank() == world.node_index
    value = np.array([r + 1.0, -r], np.float32)
    np.testing.assert_allclose(hvd.allreduce(value), [(n + 1) / 2, -(n - 1) / 2])
    np.testing.assert_array_equal(hvd.allreduce(value, op=hvd.Sum),
                                  [n * (n + 1) / 2, -n * (n - 1) / 2])
    np.testing.assert_array_equal(hvd.allreduce(value, average=False), hvd.allreduce(
        value, op=hvd.Sum))
    np.testing.assert_array_equal(hvd.allreduce(value, op=hvd.Max), [n, 0])
    np.testing.assert_array_equal(hvd.allreduce(value, op=hvd.Min), [1, -(n - 1)])
    gathered = hvd.allgather(np.full((r + 1, 2), r))          # first dimensions differ
    assert gathered.shape == (n * (n + 1) // 2, 2)
    np.testing.assert_array_equal(gathered[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
    root = n - 1
    np.testing.assert_array_equal(hvd.broadcast(np.arange(3) + r, root), np.arange(3) + root)
    assert hvd.broadcast_object({"rank": r}, root) == {"rank": root}
    assert hvd.allgather_object(r * 10) == [10 * k for k in range(n)]


def test_unsupported_options_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="op=Adasum is not supported"):
        hvd.allreduce(np.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op='Product' is not supported"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Product)
    with pytest.raises(ValueError, match="op='Adasum' is not supported"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)


def data(rows=48):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2))).astype(np.float32)
    return x, y


def model_with(optimizer, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def weights(model):
    return [np.asarray(v.value) for v in model.weights]


def same_weights_on_every_rank(model):
    for other in hvd.allgather_object(weights(model)):
        for a, b in zip(other, weights(model)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=1)
def test_distributed_optimizer_trains_like_one_process_on_the_union_of_the_batches(world):
    n, r = world.size, world.rank
    x, y = data()
    mine = slice(r, None, n)                                  # Horovod's usual shard
    # (the same start on every rank: ranks that start apart are tests/mpi/test_horovod_loops.py's)
    model = model_with(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), seed=0)
    history = model.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                              hvd.callbacks.MetricAverageCallback()])
    same_weights_on_every_rank(model)
    # one process: global batch b is the union of every rank's batch b
    shards = [np.arange(48)[k::n] for k in range(n)]
    order = np.concatenate([np.concatenate([s[b * BATCH:(b + 1) * BATCH] for s in shards])
                            for b in range(len(shards[0]) // BATCH)])
    alone = ms.keras.train_alone(model_with(keras.optimizers.SGD(0.05), seed=0))
    want = alone.fit(x[order], y[order], batch_size=BATCH * n, epochs=2, shuffle=False,
                     verbose=0)
    for got, expected in zip(weights(model), weights(alone)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    logs = hvd.allgather_object(history.history["loss"])
    assert all(other == logs[0] for other in logs)            # global logs on every rank


def test_broadcast_callback_gives_every_rank_the_roots_variables(world):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    root = world.size - 1
    for variable in model.weights:
        variable.assign(np.full(variable.shape, world.rank, np.float32))
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root)
    callback.set_model(model)
    callback.on_train_begin()                                 # nothing yet (Horovod's order)
    np.testing.assert_array_equal(weights(model)[0], np.full((3, 2), world.rank, np.float32))
    callback.on_train_batch_end(0)                            # after the first batch
    for value in weights(model):
        np.testing.assert_array_equal(value, np.full(value.shape, root, np.float32))


def test_metric_average_callback_averages_the_logs(world):
    logs = {"loss": float(world.rank), "accuracy": 2.0 * world.rank}
    hvd.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    mean = (world.size - 1) / 2
    assert logs == pytest.approx({"loss": mean, "accuracy": 2 * mean})


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_numbers_of_batches_raise_on_every_rank(world):
    x, y = data()
    rows = 3 * BATCH if world.rank == 0 else 2 * BATCH       # Horovod would hang here
    model = model_with(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    before = weights(model)
    with pytest.raises(ValueError, match=r"different numbers of batches \(rank 0: 3, rank 1: 2"):
        model.fit(x[:rows], y[:rows], batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(before, weights(model)):
        np.testing.assert_array_equal(a, b)                   # nothing trained
    model.fit(x[:rows], y[:rows], batch_size=BATCH, epochs=1, verbose=0, steps_per_epoch=2)


def test_warmup_rises_from_lr_over_size_to_lr_as_horovod_does(world):
    n = world.size
    x, y = data()
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.04, warmup_epochs=2)
    model = model_with(hvd.DistributedOptimizer(keras.optimizers.SGD(0.04)))
    mine = slice(world.rank, None, n)
    history = model.fit(x[mine], y[mine], batch_size=BATCH, epochs=3, verbose=0,
                        callbacks=[warmup])
    steps = warmup.steps_per_epoch
    assert steps == -(-len(x[mine]) // BATCH)
    # Horovod's: epoch e's last batch runs at initial/n * ((e + 1) * (n - 1) / W + 1), so the
    # warm-up's last batch runs at initial_lr; after it the rate is left alone
    last = [0.04 / n * (1 * (n - 1) / 2 + 1), 0.04, 0.04]
    np.testing.assert_allclose(history.history["lr"], last, rtol=1e-6)
    assert warmup.learning_rate(0.0) == pytest.approx(0.04 / n)


@pytest.mark.mpi(min_size=2)
def test_callbacks_given_on_rank_0_only_run_there_without_a_collective(world, tmp_path_factory):
    """Horovod's examples add ModelCheckpoint and TensorBoard on rank 0 only. Before, the
    wrapper that runs file writers on rank 0 agreed their errors at each epoch's end in a
    collective the other ranks (without the callback) never joined."""
    path = world.comm.bcast(str(tmp_path_factory.mktemp("hvd") / "model.keras")
                            if world.rank == 0 else None, root=0)
    x, y = data()
    model = model_with(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if hvd.rank() == 0:
        callbacks += [keras.callbacks.ModelCheckpoint(path),
                      keras.callbacks.TensorBoard(os.path.join(os.path.dirname(path), "logs"))]
    mine = slice(world.rank, None, world.size)
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
    world.comm.Barrier()
    assert os.path.exists(path)
    same_weights_on_every_rank(model)


@pytest.mark.mpi(min_size=1)
def test_distributed_optimizer_under_mixed_precision_is_kept_inside_the_loss_scale_wrapper(world):
    """Keras wraps the optimizer in a LossScaleOptimizer under mixed_float16: the model must
    still be distributed (before, fit was refused as 'compiled outside strategy.scope()')."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data()
        model = model_with(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
        assert type(model.optimizer).__name__ == "LossScaleOptimizer"
        mine = slice(world.rank, None, world.size)
        model.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    same_weights_on_every_rank(model)


@pytest.mark.mpi(min_size=1)
def test_distributed_optimizer_of_an_optax_transformation_averages_inside_jit(world):
    """Each rank its own batch; the jitted step's update is the one of the mean gradient, so
    the parameters equal one process's step on the union of the batches, on every rank."""
    import jax
    import jax.numpy as jnp
    import optax
    x, y = data()
    n, r = world.size, world.rank
    mine = slice(r * BATCH, (r + 1) * BATCH)
    params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}

    def loss(p, xb, yb):
        return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    state = tx.init(params)

    @jax.jit
    def step(p, s, xb, yb):
        grads = jax.grad(loss)(p, xb, yb)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s
    for _ in range(3):
        params, state = step(params, state, x[mine], y[mine])
    alone = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
    for _ in range(3):
        grads = jax.grad(loss)(alone, x[:n * BATCH], y[:n * BATCH])
        alone = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, alone, grads)
    for key in params:
        np.testing.assert_allclose(np.asarray(params[key]), np.asarray(alone[key]), rtol=1e-5,
                                   atol=1e-6)
    gathered = hvd.allgather_object(np.asarray(params["w"]))
    assert all(np.array_equal(g, gathered[0]) for g in gathered)
