"""Keras 3 (JAX backend) ``model.fit``/``evaluate``/``predict`` for a model compiled inside
``strategy.scope()`` (issue 16): NumPy arrays are cut into global batches, each rank takes its
rebatch slice (20 rows in batches of 8: at 3 ranks 3/3/2 rows, then 2/2/0 in the short last
batch), gradients are weighted by rows and summed, metrics summed. Every rank ends with the
same weights, equal (rtol 1e-5) to one process training on the same global batches; evaluate
gives the same loss on every rank; a CheckpointManager save between epochs resumes exactly."""

import functools
import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

import mpistrat as ms  # noqa: E402

pytestmark = [pytest.mark.numpy_only("Keras values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "Keras fit runs at 1-3 ranks (widths 1, 2 and an odd one); at 4 the same "
                  "engine paths run in the other suites, and make test must stay under 30 min"))]

ROWS, BATCH = 20, 8


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0 picks it)."""
    path = str(tmp_path_factory.mktemp("kerasfit")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2)) + 0.1).astype(np.float32)
    return x, y


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def weights(model):
    return [np.asarray(v.value) for v in model.weights]


def distributed(strategy, x, y):
    """``(x, y)`` in global batches of ``BATCH``, each rank its slice."""
    return strategy.experimental_distribute_dataset(
        ms.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))


def same_on_every_rank(strategy, values):
    for value in values:
        stacked = np.asarray(strategy.gather(np.asarray(value)[None], axis=0))
        for other in stacked:
            np.testing.assert_array_equal(other, value)


@functools.lru_cache(maxsize=None)
def reference(epochs):
    """One process, no strategy, the same global batches (built once per run)."""
    model = ms.keras.train_alone(build())
    x, y = data()
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history


@pytest.mark.mpi(min_size=1)
def test_fit_matches_one_process_and_ranks_agree(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    same_on_every_rank(strategy, weights(model))
    single, single_history = reference(epochs=2)
    for got, want in zip(weights(model), weights(single)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], single_history.history[key],
                                   rtol=1e-5)
        same_on_every_rank(strategy, [np.asarray(history.history[key])])
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    want = single.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    same_on_every_rank(strategy, [np.float64(logs["loss"]), np.float64(logs["mae"])])
    np.testing.assert_allclose(logs["loss"], want["loss"], rtol=1e-5)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    assert predictions.shape == (ROWS, 2)
    same_on_every_rank(strategy, [predictions])
    np.testing.assert_allclose(predictions, model.predict_on_batch(x), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rows", [1, 2, 7, ROWS])
def test_predict_is_sharded_and_gathered_in_order(world, rows):
    """Each rank predicts its block of rows (a rank without rows predicts none), every rank
    returns every row in order: the same as one process, for one output and for two."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, _ = data()
    x = x[:rows]
    with strategy.scope():
        model = build()
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3)(inputs)
        two = keras.Model(inputs, {"a": hidden, "b": keras.layers.Dense(1)(hidden)})
        two.compile(loss="mse")
    class Batches(keras.callbacks.Callback):   # how many batches this rank predicted
        count = 0

        def on_predict_batch_end(self, batch, logs=None):
            Batches.count += 1

    got = model.predict(x, batch_size=4, verbose=0, callbacks=[Batches()])
    assert got.shape == (rows, 2)
    np.testing.assert_allclose(got, model.predict_on_batch(x), rtol=1e-5, atol=1e-6)
    same_on_every_rank(strategy, [got])
    mine = rows // world.size + (world.rank < rows % world.size)   # its block of rows
    assert Batches.count == max(1, -(-mine // 4))                  # its batches only
    both = two.predict(x, batch_size=4, verbose=0)
    assert set(both) == {"a", "b"} and both["a"].shape == (rows, 3)
    np.testing.assert_allclose(both["b"], two.predict_on_batch(x)["b"], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_shuffled_fit_is_the_same_on_every_rank(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, validation_data=(x[:8], y[:8]))
    same_on_every_rank(strategy, weights(model))


@pytest.mark.mpi(min_size=1)
def test_checkpoint_manager_mid_fit_resumes_exactly(world, shared_dir):
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    ckpt = ms.Checkpoint(model=model, optimizer=model.optimizer)
    manager = ms.CheckpointManager(ckpt, shared_dir, max_to_keep=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    manager.save()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with strategy.scope():
        fresh = build()
    restored = ms.Checkpoint(model=fresh, optimizer=fresh.optimizer)
    restored.restore(manager.latest_checkpoint)
    fresh.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(weights(fresh), weights(model)):
        np.testing.assert_array_equal(got, want)
    same_on_every_rank(strategy, weights(fresh))


@pytest.mark.mpi(min_size=1)
def test_each_rank_trains_on_its_rebatch_slice(world):
    from mpistrat.data.rebatch import rebatch_slices
    from mpistrat.keras.trainer import _RankShare
    x, y = data()
    share = _RankShare((x, y), BATCH, world.rank, world.size, False, 0)
    seen = [share[i] for i in range(len(share))]
    assert len(seen) == 3
    for index, (bx, by) in enumerate(seen):
        lo, hi = rebatch_slices(min(BATCH, ROWS - index * BATCH), world.size)[world.rank]
        np.testing.assert_array_equal(bx, x[index * BATCH + lo:index * BATCH + hi])
        np.testing.assert_array_equal(by, y[index * BATCH + lo:index * BATCH + hi])
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build()
    assert "train_step" in vars(model)   # the distributed step is used


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("given", ["distributed", "plain ms.data dataset"])
def test_fit_on_a_distributed_dataset_matches_arrays(world, given):
    """A plain ms.data dataset of global batches is distributed by fit itself, as Keras does
    with a tf.data dataset under a TensorFlow strategy (before, fit refused it)."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    dataset = distributed(strategy, x, y) if given == "distributed" else \
        ms.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = model.fit(dataset, epochs=2, verbose=0)
    single, single_history = reference(epochs=2)
    for got, want in zip(weights(model), weights(single)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], single_history.history["loss"],
                               rtol=1e-5)
    logs = model.evaluate(dataset, verbose=0, return_dict=True)
    want = single.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["loss"], want["loss"], rtol=1e-5)


# -- weights made in the scope start alike; BatchNormalization's statistics stay alike ---------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("built", [True, False], ids=["built-at-compile", "built-by-fit"])
def test_weights_made_in_the_scope_start_from_rank_0s_values(world, built):
    """Each rank draws other initial weights (as unseeded processes do); before, they stayed
    apart through fit, silently. Now compile (or fit, for a model built only then) gives
    every rank rank 0's values, as TensorFlow's scope does."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    keras.utils.set_random_seed(100 + world.rank)
    with strategy.scope():
        layers = [keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)]
        model = keras.Sequential(([keras.Input((4,))] if built else []) + layers)
        drawn = weights(model) if built else None
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    if built:
        same_on_every_rank(strategy, weights(model))
        rank0 = world.comm.bcast(drawn, root=0)
        for got, want in zip(weights(model), rank0):
            np.testing.assert_array_equal(got, want)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    same_on_every_rank(strategy, weights(model))


@pytest.mark.mpi(min_size=1)
def test_batch_norm_statistics_agree_after_fit_and_checkpoint(world, shared_dir):
    """Before, each rank's moving statistics drifted apart and a save refused them ('values
    differ between ranks: model/layer-1/moving_mean'). They are the mean over the ranks,
    the value TensorFlow saves of its per-replica copies; at one rank, one process's."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()

    def bn_model():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                                  keras.layers.BatchNormalization(),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        return model

    with strategy.scope():
        model = bn_model()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    same_on_every_rank(strategy, weights(model))
    moving = [np.asarray(v.value) for v in model.non_trainable_weights]
    assert moving and not np.allclose(moving[0], 0.0)      # the statistics did move
    if world.size == 1:
        single = bn_model()
        single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        for got, want in zip(weights(model), weights(single)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    path = ms.Checkpoint(model=model).save(os.path.join(shared_dir, "bn"))
    with strategy.scope():
        fresh = bn_model()
    ms.Checkpoint(model=fresh).restore(path).assert_consumed()
    for got, want in zip(weights(fresh), weights(model)):
        assert got.tobytes() == want.tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["fewer rows", "other values"])
def test_ranks_that_pass_other_arrays_are_refused_on_every_rank(world, how):
    """Before, per-rank arrays of different lengths were silently cut to common rows."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    if world.rank == world.size - 1:
        x, y = (x[:-3], y[:-3]) if how == "fewer rows" else (x + 1, y)
    with strategy.scope():
        model = build()
    before = weights(model)
    with pytest.raises(ValueError, match="every rank passes the same arrays") as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert f"rank {world.size - 1}" in str(info.value)
    for got, want in zip(weights(model), before):   # nothing trained
        np.testing.assert_array_equal(got, want)


@pytest.mark.mpi(min_size=1)
def test_validation_data_may_be_a_distributed_dataset(world):
    """Before, Keras refused it: 'Unrecognized data type'."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        validation_data=distributed(strategy, x, y))
    want = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    np.testing.assert_allclose(history.history["val_loss"][-1], want["loss"], rtol=1e-5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("reduction", ["none", None])
def test_a_loss_per_row_is_refused_by_name(world, reduction):
    """Before, reduction='none' was summed and weighted by rows: other weights than
    TensorFlow's, silently (Keras on JAX refuses it in one process). reduction='sum' trains as
    TensorFlow does (test_keras_tf_oracle.py)."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.MeanSquaredError(reduction=reduction))
    before = weights(model)
    with pytest.raises(ValueError, match=f"reduction={reduction!r}"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(model)))


class Penalty(keras.layers.Layer):
    """An ``add_loss`` term of the activations, not 0 on a row of zeros."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, x):
        self.add_loss(self.scale * keras.ops.sum(keras.ops.square(x - 0.5)))
        return x


@pytest.mark.mpi(min_size=1)
def test_a_rank_whose_first_batch_is_empty_builds_and_trains_as_one_process(world):
    """2 rows over 3 ranks, a weight regulariser, the model's losses and metrics built by fit
    itself: the third rank's first batch has no rows, and Keras's symbolic build on it failed
    (a (0,) data loss added to the regularisation loss). It trains as one process on the
    global batch, with the same logged losses."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    x, y = x[:2], y[:2]

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh",
                               kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        return model

    with strategy.scope():
        model = make()
    history = model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    alone = ms.keras.train_alone(make())
    expected = alone.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(weights(model), weights(alone)):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)
    same_on_every_rank(strategy, weights(model))


@pytest.mark.mpi(min_size=1)
def test_an_empty_replica_of_a_summed_loss_adds_no_activity_or_add_loss_terms(world):
    """2 rows over 3 ranks: the third replica has none. Before, under reduction='sum' it ran
    one zero-weighted row of zeros and kept its whole gradient, so the activity regulariser
    and the add_loss term of that row's activations moved the weights (TensorFlow's empty
    replica adds 0 for them). TensorFlow's rule, at every width N: the data losses summed, the
    weight regulariser once (1/N on each of N replicas), each add_loss term of the rows once
    divided by N, and each replica's activity regulariser (Keras divides it by the replica's
    rows) divided by N: with one row per replica, the mean over the 2 rows times
    min(2, N) / N. That is one process's model with those factors."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    x, y = x[:2], y[:2]

    def make(activity, penalty):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh", bias_initializer="ones",
                               kernel_regularizer=keras.regularizers.L2(0.01),
                               activity_regularizer=keras.regularizers.L1(0.1 * activity)),
            Penalty(0.05 * penalty), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.MeanSquaredError(reduction="sum"))
        return model

    with strategy.scope():
        model = make(1.0, 1.0)
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)   # (built by fit itself)
    alone = ms.keras.train_alone(make(min(2, world.size) / world.size,
                                              1.0 / world.size))
    alone.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(weights(model), weights(alone)):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    same_on_every_rank(strategy, weights(model))


@pytest.mark.mpi(min_size=1)
def test_validation_split_holds_out_the_last_rows_as_one_process_does(world):
    """Before, validation_split was refused under a strategy."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_split=0.25)
    single = ms.keras.train_alone(build())
    want = single.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                      validation_split=0.25)
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(history.history[key], want.history[key], rtol=1e-5)
    for got, expected in zip(weights(model), weights(single)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    same_on_every_rank(strategy, weights(model))


def build_normalized(layer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, use_bias=False),
                              layer(momentum=0.5),
                              keras.layers.Activation("tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


@pytest.mark.mpi(min_size=1)
def test_sync_batch_normalization_trains_as_one_process_on_the_global_batch(world):
    """Keras 3 refuses BatchNormalization(synchronized=True) outside TensorFlow, and each
    replica normalised with its own rows. SyncBatchNormalization sums the statistics over
    the ranks (forward) and their gradients (backward): at 1-3 ranks, uneven and empty
    slices included (20 rows in batches of 8: 2/2/0 rows in the last at 3 ranks), fit gives
    the weights and moving statistics of one process training plain BatchNormalization on
    the same global batches."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build_normalized(ms.keras.SyncBatchNormalization)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    single = ms.keras.train_alone(build_normalized(keras.layers.BatchNormalization))
    single.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    for got, want in zip(weights(model), weights(single)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    same_on_every_rank(strategy, weights(model))
    np.testing.assert_allclose(model.predict(x, verbose=0), single.predict(x, verbose=0),
                               rtol=2e-5, atol=2e-6)
    from mpistrat.keras.sync_bn import synchronizes
    with strategy.scope():       # a clone (or a loaded model) keeps synchronising
        clone = keras.models.clone_model(model)
    assert synchronizes(clone) == (world.size > 1)
    assert clone.layers[1].get_config()["synchronized"] is True


OFFSETS = np.array([4012.34, 5000.57, 5987.65])


def far_from_zero(rows):
    """Features of mean ~5000 and std 1 over the batch (float32): there E[x^2] - mean^2
    cancels to rounding noise. (Standardised: a 4-row draw may have std 0.1, and Keras's normalisation
    ``x * inv - mean * inv`` then loses 4e-3 at this offset, whatever the moments.)"""
    z = np.random.default_rng(44).standard_normal((rows, len(OFFSETS)))
    return (OFFSETS + (z - z.mean(axis=0)) / z.std(axis=0)).astype(np.float32)


def rebatch_slice(rows, world):
    """This rank's rows of a global batch (the DATA split: slices of ceil(rows / N) rows in
    rank order, the last non-empty one takes the rest, later ranks get none)."""
    per = -(-rows // world.size)
    start = min(world.rank * per, rows)
    return slice(start, min(start + per, rows))


def synchronized_bn(strategy):
    """A built SyncBatchNormalization on its synchronised path at any width (at 1 rank it
    would otherwise be Keras's own layer)."""
    from mpistrat.keras.sync_bn import _STRATEGY_OF
    with strategy.scope():
        layer = ms.keras.SyncBatchNormalization()
    _STRATEGY_OF[layer] = strategy
    layer.build((None, len(OFFSETS)))
    return layer


@pytest.mark.mpi(min_size=1)
def test_sync_batch_normalization_variance_of_offset_features_is_near_1_not_0(world):
    """Issue 44: the variance was E[x^2] - mean^2 in float32; at mean 5000, std 1 (x^2 ~
    2.5e7, kept to ~2) it came out as rounding noise (0, or 8 for a true 1). The
    synchronised moments now match float64."""
    import jax.numpy as jnp
    strategy = ms.MultiWorkerMirroredStrategy()
    x = far_from_zero(ROWS)
    mean, variance = synchronized_bn(strategy)._moments(
        jnp.asarray(x[rebatch_slice(ROWS, world)]), None)
    exact = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(mean), exact.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(variance), exact.var(axis=0), rtol=1e-3)
    np.testing.assert_allclose(np.asarray(variance), 1.0, atol=1e-2)   # not ~0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rows", [ROWS, 4])
def test_sync_batch_normalization_is_exact_for_features_far_from_zero(world, rows):
    """Issue 44: with that variance the outputs were off by up to ~30 times (a variance of 0
    divides by sqrt(epsilon)). Now the squared deviations from the global mean are
    all-reduced: each rank's output and input gradient (of the loss fit uses, weighted by
    rows) match float64 NumPy on the global batch (20 rows: 7/7/6 at 3 ranks; 4 rows: 2/2/0, the
    empty replica joining every all-reduce, forward and backward)."""
    import jax
    import jax.numpy as jnp
    strategy = ms.MultiWorkerMirroredStrategy()
    layer = synchronized_bn(strategy)
    x = far_from_zero(rows)
    cotangent = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    mine = rebatch_slice(rows, world)
    own = mine.stop - mine.start
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def loss(inputs):   # this replica's mean over its rows, as in fit
        out, _ = layer.stateless_call(trainable, non_trainable, inputs, training=True)
        return jnp.sum(out * cotangent[mine]) / max(own, 1), out

    grad, out = jax.grad(loss, has_aux=True)(jnp.asarray(x[mine]))
    grad = np.asarray(grad) * own / rows     # fit weights each replica's gradient by its rows
    exact = x.astype(np.float64)
    std = np.sqrt(exact.var(axis=0) + layer.epsilon)
    normalized = (exact - exact.mean(axis=0)) / std
    c = cotangent.astype(np.float64)
    want = (c - c.mean(axis=0) - normalized * (c * normalized).mean(axis=0)) / (rows * std)
    np.testing.assert_allclose(np.asarray(out), normalized[mine], rtol=1e-3, atol=2e-3)
    np.testing.assert_allclose(grad, want[mine], rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.mpi(min_size=1)
def test_callbacks_that_write_files_write_once_from_rank_0(world, shared_dir):
    """Before, ModelCheckpoint on every rank failed with HDF5's 'unable to lock file, errno =
    11', and CSVLogger wrote each line once per rank."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    weights_file = os.path.join(shared_dir, "best.weights.h5")
    log_file = os.path.join(shared_dir, "log.csv")
    callbacks = [keras.callbacks.ModelCheckpoint(weights_file, save_weights_only=True),
                 keras.callbacks.CSVLogger(log_file)]
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    assert os.path.exists(weights_file)                      # complete when fit returns
    with open(log_file) as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("epoch") and [line.split(",")[0] for line in lines[1:]] == \
        ["0", "1", "2"], lines
    with strategy.scope():
        loaded = build()
    loaded.load_weights(weights_file)
    for got, want in zip(weights(loaded), weights(model)):
        np.testing.assert_array_equal(got, want)


class StopAt(keras.callbacks.Callback):
    """Interrupts training at the end of an epoch, as a preempted job would end."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"stopped after epoch {epoch}")


@pytest.mark.mpi(min_size=1)
def test_backup_and_restore_resumes_every_rank_from_rank_0s_backup(world, shared_dir):
    """Before, every rank wrote the backup (HDF5: 'unable to lock file'). Now rank 0 writes
    it and every rank restores it: the interrupted run resumes at the next epoch and ends
    with the weights of a run that was never interrupted."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    backup = os.path.join(shared_dir, "backup")
    with strategy.scope():
        model = build()
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), StopAt(1)])
    assert sorted(os.listdir(backup)) == ["latest.weights.h5", "training_metadata.json"]
    with strategy.scope():
        resumed = build()       # fresh weights, as a restarted job has
    seen = []
    epochs = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: seen.append(e))
    resumed.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup), epochs])
    assert seen == [2, 3]
    assert not os.path.exists(backup)         # deleted at the end of training, as in Keras
    with strategy.scope():
        whole = build()
    whole.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(weights(resumed), weights(whole)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    same_on_every_rank(strategy, weights(resumed))


@pytest.mark.mpi(min_size=1)
def test_a_failing_rank_0_callback_raises_on_every_rank(world, shared_dir):
    """ModelCheckpoint cannot write (its directory is a regular file): rank 0's error is
    raised on every rank at the end of the epoch, not left to hang the others."""
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    blocker = os.path.join(shared_dir, "not-a-directory")
    if world.rank == 0:
        open(blocker, "w").close()
    world.comm.Barrier()
    callback = keras.callbacks.ModelCheckpoint(os.path.join(blocker, "w.weights.h5"),
                                               save_weights_only=True)
    with pytest.raises(Exception, match=r"rank 0: ModelCheckpoint.on_epoch_end"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[callback])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("when", ["before the strategy", "built in the scope, compiled outside"])
def test_fit_of_a_model_compiled_outside_the_scope_is_refused_on_every_rank(world, when):
    """Without the refusal each rank trains its own copy (the weights drift apart), silently."""
    x, y = data()
    if when == "before the strategy":
        model = build()
        strategy = ms.MultiWorkerMirroredStrategy()
    else:
        strategy = ms.MultiWorkerMirroredStrategy()
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    before = weights(model)
    with pytest.raises(ValueError, match=r"compiled outside strategy\.scope\(\) while a "
                                         r"MultiWorkerMirroredStrategy of \d replicas"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(model)))  # nothing trained
    ms.keras.distribute_model(model, strategy)       # the fix the error names
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    same_on_every_rank(strategy, weights(model))


def test_load_model_in_the_scope_comes_back_compiled_and_distributed(world, shared_dir):
    """Keras's load_model compiles the model from its saved config (the compile wrapper is
    Keras's own method for that check), and inside the scope that compile distributes it."""
    x, y = data()
    strategy = ms.MultiWorkerMirroredStrategy()
    path = os.path.join(shared_dir, "model.keras")
    if world.rank == 0:
        build().save(path)
    world.comm.Barrier()
    with strategy.scope():
        model = keras.models.load_model(path)
    assert model.compiled and model.optimizer is not None
    assert getattr(model, "_mpistrat_strategy", None) is strategy
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    same_on_every_rank(strategy, weights(model))


@pytest.mark.mpi(min_size=1)
def test_keras_tensorboard_writes_the_logs_from_rank_0_without_tensorflow(world, shared_dir):
    """keras.callbacks.TensorBoard needs TensorFlow to write (ModuleNotFoundError in fit);
    under a strategy it is swapped for ms.summary's: epoch_* scalars in train/ and validation/
    and batch_* every update_freq steps, one file each, from rank 0 alone."""
    from mpistrat.tfformats import messages
    strategy = ms.MultiWorkerMirroredStrategy()
    x, y = data()
    with strategy.scope():
        model = build()
    logs = os.path.join(shared_dir, "logs")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, validation_data=(x, y),
                        callbacks=[keras.callbacks.TensorBoard(logs, update_freq=1)])
    world.comm.Barrier()

    def scalars(kind):
        (path,) = [os.path.join(logs, kind, f) for f in os.listdir(os.path.join(logs, kind))
                   if f.startswith("events.out.tfevents.")]   # (not our reader's index cache)
        found = {}
        for record in ms.data.TFRecordDataset(path):
            event = messages.parse("Event", bytes(record), path)
            for value in (event.summary.value if event.WhichOneof("what") == "summary" else []):
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
        return found
    train, validation = scalars("train"), scalars("validation")
    np.testing.assert_allclose([v for _, v in train["epoch_loss"]], history.history["loss"],
                               rtol=1e-6)
    np.testing.assert_allclose([v for _, v in validation["epoch_loss"]],
                               history.history["val_loss"], rtol=1e-6)
    assert [s for s, _ in train["epoch_mae"]] == [0, 1]
    assert [s for s, _ in train["batch_loss"]] == list(range(1, 2 * -(-ROWS // BATCH) + 1))
