"""mpistrat.horovod's API beyond the collectives (issue 43), by Horovod 0.28's rules:
``is_initialized``/``shutdown`` (collectives raise ``NotInitializedError`` until ``init()``
again; MPI stays up), ``mpi_threads_supported`` (MPI's thread level), ``join`` (an agreement
that every rank finished, returning the last rank as Horovod reports it, refused by name while
another rank still reduces), ``hvd.elastic`` (refused by name), the learning-rate callbacks
(the rate of every batch as Horovod's formulas give it, and its momentum correction as the
update Horovod's optimizer makes) and ``load_model`` (the optimizer wrapped and its state kept,
``.keras`` and legacy ``.h5``). The Keras tests run at 1-3 ranks, the others at 1-4."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")

import mpistrat.horovod as hvd  # noqa: E402
from mpistrat.runtime import settings  # noqa: E402

pytestmark = pytest.mark.numpy_only("NumPy values and Keras models built here")

ROWS, BATCH = 48, 8
NOT_INITIALIZED = r"Horovod has not been initialized; use hvd\.init\(\)"


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def keras():
    if MPI.COMM_WORLD.Get_size() > 3:
        pytest.skip("Horovod Keras programs run at 1-3 ranks (the engine paths run at 4 in "
                    "the other suites)")
    return pytest.importorskip("keras")


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0 picks it)."""
    path = str(tmp_path_factory.mktemp("hvdapi")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


# -- init, shutdown, MPI facts ------------------------------------------------------------------

def test_shutdown_makes_calls_raise_until_init_again_and_leaves_mpi_up(world):
    assert hvd.is_initialized()
    hvd.init()                                               # a second init does nothing
    assert hvd.is_initialized() and hvd.size() == world.size
    hvd.shutdown()
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, hvd.local_rank, hvd.cross_size, hvd.join,
                 hvd.mpi_threads_supported,
                 lambda: hvd.allreduce(np.ones(2)),
                 lambda: hvd.allgather(np.ones((1, 2))),
                 lambda: hvd.broadcast(np.ones(2), 0),
                 lambda: hvd.broadcast_object(1, 0),
                 lambda: hvd.allgather_object(1)):
        with pytest.raises(hvd.NotInitializedError, match=NOT_INITIALIZED) as err:
            call()
        assert isinstance(err.value, ValueError)             # Horovod's class there
        assert "hvd.shutdown() was called" in str(err.value)
    hvd.shutdown()                                           # (twice is fine)
    assert not MPI.Is_finalized()                            # MPI itself is still up
    assert world.comm.allreduce(1) == world.size
    hvd.init()
    assert hvd.is_initialized() and hvd.rank() == world.rank
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum), [world.size] * 2)


def test_mpi_facts_follow_mpi_and_what_mpistrat_has():
    assert hvd.mpi_threads_supported() is (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert hvd.mpi_enabled() is True and hvd.mpi_built() is True
    assert hvd.gloo_enabled() is False and hvd.gloo_built() is False
    from mpistrat.runtime.devices import nccl_available
    code = hvd.nccl_built()
    assert isinstance(code, int) and (code > 0) == nccl_available()[0]


# -- join ------------------------------------------------------------------------------------

def test_join_on_every_rank_returns_the_last_rank_everywhere(world):
    """Horovod records the joins of one round in rank order and reports the last."""
    np.testing.assert_array_equal(hvd.allreduce(np.full(3, world.rank + 1.0), op=hvd.Sum),
                                  np.full(3, world.size * (world.size + 1) / 2))
    last = hvd.join()
    assert last == world.size - 1 and type(last) is int
    assert hvd.allgather_object(last) == [world.size - 1] * world.size
    assert hvd.join() == world.size - 1                     # again, after a join
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum), [world.size] * 2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not settings.get("MPISTRAT_VALIDATE"),
                    reason="a join beside an all-reduce is caught by the validation probe")
def test_a_rank_joining_while_others_reduce_raises_on_every_rank(world):
    """Horovod would let rank 0 join and reduce zeros for it; here every rank raises, naming
    the join, and they stay in step."""
    if world.rank == 0:
        with pytest.raises(hvd.NotSupportedError, match="still in a collective") as err:
            hvd.join()
        assert "same number of steps" in str(err.value)
    else:
        with pytest.raises(ValueError, match="hvd.join"):
            hvd.allreduce(np.ones(3), op=hvd.Sum)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum), np.full(3, world.size))
    assert hvd.join() == world.size - 1


# -- elastic ---------------------------------------------------------------------------------

def test_elastic_is_refused_by_name_pointing_to_mpistrats_elastic_jobs():
    import mpistrat.horovod.elastic as elastic
    assert hvd.elastic is elastic
    with pytest.raises(hvd.NotSupportedError, match=r"hvd\.elastic\.run is not supported") as err:
        @hvd.elastic.run
        def train(state):
            pass
    assert "slurm/train_elastic.sbatch" in str(err.value)
    assert isinstance(err.value, NotImplementedError)
    for name in ("State", "ObjectState", "KerasState", "TensorFlowKerasState",
                 "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"):
        with pytest.raises(hvd.NotSupportedError, match=f"hvd.elastic.{name} is not supported"):
            getattr(hvd.elastic, name)(None, batch=0, epoch=0)


# -- the learning-rate callbacks -----------------------------------------------------------------

def data():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((ROWS, 4))
    y = x @ rng.standard_normal((4, 2)) + 0.3
    return x.astype(np.float32), y.astype(np.float32)


def start_weights():
    rng = np.random.default_rng(7)
    return rng.standard_normal((4, 2)).astype(np.float32), np.full(2, 0.1, np.float32)


def linear_model(keras, optimizer):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.set_weights(list(start_weights()))
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss="mse")
    return model


def recorder(keras):
    """The rate each batch runs at (placed after the callback that sets it)."""
    class Rates(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rates = []

        def on_train_batch_begin(self, batch, logs=None):
            if hasattr(self.model, "jax_state_sync"):
                self.model.jax_state_sync()
            self.rates.append(np.float32(np.asarray(self.model.optimizer.learning_rate)))
    return Rates()


def fit_recording(keras, world, callback, optimizer, epochs):
    x, y = data()
    mine = slice(world.rank, None, world.size)
    model = linear_model(keras, optimizer)
    rates = recorder(keras)
    history = model.fit(x[mine], y[mine], batch_size=BATCH, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[callback, rates])
    steps = ROWS // world.size // BATCH
    got = np.array(rates.rates).reshape(epochs, steps)
    return got, np.float32(history.history["lr"]), steps, model


def test_schedule_staircase_sets_horovods_rate_at_each_epochs_first_batch(keras, world):
    """Horovod: from start_epoch up to end_epoch, epoch e's first batch sets initial_lr *
    multiplier ** (e - start_epoch), which holds for the whole epoch; outside, the rate is
    left as it was."""
    schedule = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.05, multiplier=0.5, start_epoch=1, end_epoch=3)
    got, logged, steps, _ = fit_recording(keras, world, schedule,
                                          keras.optimizers.SGD(0.02), epochs=4)
    per_epoch = [0.02, 0.05 * 0.5 ** 0, 0.05 * 0.5 ** 1, 0.05 * 0.5 ** 1]
    want = np.float32([[rate] * steps for rate in per_epoch])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(logged, np.float32(per_epoch))
    assert hvd.allgather_object(got.tolist()) == [got.tolist()] * world.size


def test_schedule_smooth_sets_every_batch_from_the_fractional_epoch(keras, world):
    """staircase=False: batch b of epoch e runs at initial_lr * multiplier(e + b / steps)
    (steps found from fit); a function multiplier takes that epoch as it is."""
    def multiplier(epoch):
        return 1.0 / (1.0 + epoch)
    schedule = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.1, multiplier=multiplier, staircase=False, end_epoch=2)
    got, logged, steps, _ = fit_recording(keras, world, schedule,
                                          keras.optimizers.SGD(0.3), epochs=3)
    assert schedule.steps_per_epoch == steps
    want = [[0.1 * multiplier(e + float(b) / steps) for b in range(steps)] for e in range(2)]
    want.append([want[1][-1]] * steps)                       # epoch 2: left alone
    np.testing.assert_array_equal(got, np.float32(want))
    np.testing.assert_array_equal(logged, np.float32([w[-1] for w in want]))
    # a number: the exponential, in fractional epochs
    assert schedule.learning_rate(0.5) == 0.1 * multiplier(0.5)
    smooth = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=2, staircase=False)
    assert smooth.learning_rate(3.5) == 0.1 * 0.5 ** 1.5


def test_warmup_sets_horovods_rate_at_every_batch(keras, world):
    """Horovod's warm-up: batch b of epoch e (e < warmup) runs at initial_lr * (1 / size *
    ((e + b / steps + 1 / steps) * (size - 1) / warmup + 1)); afterwards it is left alone."""
    n, warmup = world.size, 2
    callback = hvd.callbacks.LearningRateWarmupCallback(0.08, warmup_epochs=warmup)
    got, logged, s, _ = fit_recording(keras, world, callback, keras.optimizers.SGD(0.08),
                                      epochs=3)
    want = [[0.08 * (1.0 / n * ((e + float(b) / s + 1.0 / s) * (n - 1) / warmup + 1))
             for b in range(s)] for e in range(warmup)]
    want.append([want[-1][-1]] * s)
    np.testing.assert_array_equal(got, np.float32(want))
    assert got[warmup - 1, -1] == np.float32(0.08)           # the warm-up's last batch
    np.testing.assert_array_equal(logged, np.float32([w[-1] for w in want]))


def horovod_momentum_run(world, rates, kind, momentum, correction):
    """One process on the union of the ranks' batches, in float64, by Horovod's rule: the
    batch whose rate changes from old to new runs with momentum * new / old, in Keras's
    updates (SGD: v = mu * v - lr * g, then w += v, or w += mu * v - lr * g with Nesterov;
    RMSprop: s = rho * s + (1 - rho) * g**2, m = mu * m + lr * g / sqrt(s + eps), w -= m)."""
    x, y = data()
    n = world.size
    shards = [np.arange(ROWS)[k::n] for k in range(n)]
    params = [v.astype(np.float64) for v in start_weights()]
    buffers = [np.zeros_like(p) for p in params]
    squares = [np.zeros_like(p) for p in params]
    old = float(rates[0][0])
    for epoch_rates in rates:
        for step, rate in enumerate(epoch_rates):
            rows = np.concatenate([s[step * BATCH:(step + 1) * BATCH] for s in shards])
            error = x[rows] @ params[0] + params[1] - y[rows]
            grads = [2.0 * x[rows].T.astype(np.float64) @ error / error.size,
                     2.0 * error.sum(axis=0) / error.size]
            lr = float(rate)
            mu = momentum * lr / old if correction and lr != old else momentum
            for i, g in enumerate(grads):
                if kind == "rmsprop":
                    squares[i] = 0.9 * squares[i] + 0.1 * g * g
                    buffers[i] = mu * buffers[i] + lr * g / np.sqrt(squares[i] + 1e-7)
                    params[i] = params[i] - buffers[i]
                    continue
                buffers[i] = mu * buffers[i] - lr * g
                params[i] = params[i] + (mu * buffers[i] - lr * g if kind == "nesterov"
                                         else buffers[i])
            old = lr
    return params


@pytest.mark.parametrize("kind", ["sgd", "nesterov", "rmsprop"])
def test_momentum_correction_makes_horovods_update(keras, world, kind):
    callback = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.05, multiplier=0.6, start_epoch=1, end_epoch=3)
    optimizer = keras.optimizers.RMSprop(0.04, momentum=0.8) if kind == "rmsprop" else \
        keras.optimizers.SGD(0.04, momentum=0.8, nesterov=kind == "nesterov")
    got, _, steps, model = fit_recording(keras, world, callback, optimizer, epochs=4)
    rates = got.tolist()                                    # (checked by the test above)
    want = horovod_momentum_run(world, rates, kind, 0.8, correction=True)
    weights = [np.asarray(v.value) for v in model.weights]
    for a, e in zip(weights, want):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6)
    plain = horovod_momentum_run(world, rates, kind, 0.8, correction=False)
    assert not np.allclose(weights[0], plain[0], rtol=1e-4)  # (the correction shows)
    for other in hvd.allgather_object(weights):
        for a, e in zip(other, weights):
            np.testing.assert_array_equal(a, e)


def test_momentum_correction_of_other_momentum_optimizers_is_refused_by_name(keras, world):
    class Heavy(keras.optimizers.Adam):
        momentum = 0.5                         # a momentum, neither SGD's nor RMSprop's
    x, y = data()
    mine = slice(world.rank, None, world.size)
    model = linear_model(keras, Heavy(0.01))
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.01, warmup_epochs=1)
    with pytest.raises(hvd.NotSupportedError, match="momentum_correction for Heavy is not "
                                                    "supported.*momentum_correction=False"):
        model.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, verbose=0, callbacks=[warmup])
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.01, warmup_epochs=1,
                                                      momentum_correction=False)
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, verbose=0, callbacks=[warmup])
    with pytest.raises(ValueError, match="initial_lr is required"):
        hvd.callbacks.LearningRateScheduleCallback(None, 0.5)


# -- load_model ------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_load_model_wraps_the_optimizer_and_keeps_its_state(keras, world, shared_dir, suffix):
    """Horovod's load_model: the file's optimizer, wrapped in DistributedOptimizer, with its
    state (momentums, iterations): the loaded model trains on exactly as the saved one."""
    x, y = data()
    mine = slice(world.rank, None, world.size)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
                  loss=keras.losses.MeanSquaredError())
    model.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(shared_dir, "model" + suffix)
    if world.rank == 0:
        model.save(path)
    world.comm.Barrier()
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__name__ == "SGD" and loaded.optimizer.momentum == 0.9
    assert loaded.optimizer._mpistrat_horovod is not None   # DistributedOptimizer's mark
    saved = [np.asarray(v.value) for v in model.optimizer.variables]
    restored = [np.asarray(v.value) for v in loaded.optimizer.variables]
    assert len(restored) == len(saved) == 2 + 4             # iterations, rate, 4 momentums
    for a, b in zip(restored, saved):
        np.testing.assert_array_equal(a, b)
    for m in (model, loaded):
        m.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-6,
                                   atol=1e-7)
    if world.size > 1:                                      # Keras's alone: not distributed
        plain = keras.models.load_model(path)
        with pytest.raises(ValueError, match="compiled outside strategy.scope"):
            plain.fit(x[mine], y[mine], batch_size=BATCH, epochs=1, verbose=0)


def test_load_model_refuses_what_distributed_optimizer_refuses(keras, shared_dir):
    path = os.path.join(shared_dir, "none.keras")
    with pytest.raises(ValueError, match="compression='fp16' is not a compressor"):
        hvd.load_model(path, compression="fp16")
    with pytest.raises(hvd.NotSupportedError, match="op='Adasum' is not supported"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    with pytest.raises(hvd.NotSupportedError, match="legacy_opts=True"):
        hvd.load_model(path, legacy_opts=True)
