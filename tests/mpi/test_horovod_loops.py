"""mpistrat.horovod's optimizer and callbacks beyond plain ``fit`` (issue 43), by Horovod 0.28's
rules, each against what one process computes from every rank's gradients:

* ``hvd.DistributedOptimizer`` in a custom loop: ``apply_gradients`` reduces the ranks'
  gradients (``Average``, ``Sum``, ``gradient_predivide_factor``, ``Compression.fp16``: the
  numbers of ``hvd.allreduce`` with the same options, bit for bit), ``backward_passes_per_step``
  sums N local passes and applies on the N-th (over N with ``average_aggregated_gradients``),
  ``stateless_apply`` inside ``jax.jit`` reduces too, and the optax form accumulates inside jit;
  ``fit`` with ``op=Sum`` or fp16 compression gives Horovod's numbers (no second reduction), and
  refuses ``backward_passes_per_step`` by name;
* nothing is broadcast at compile: ranks start from their own weights, the first batch's
  averaged gradient is applied on each, then ``BroadcastGlobalVariablesCallback(root)`` gives
  every rank the root's model and optimizer; ranks that start apart with no such callback
  raise by name; Horovod's ``.h5`` resume (rank 0 ``hvd.load_model``, the others afresh) trains on
  from rank 0's state;
* per-rank generators of different lengths raise on every rank naming each rank's count;
* a ``BackupAndRestore`` given on rank 0 only resumes every rank at rank 0's epoch with its
  weights and optimizer (the run equals an uninterrupted one); given elsewhere but not on rank
  0 it is refused by name.

Keras runs at 1-3 ranks (as tests/mpi/test_keras_fit.py)."""

import os

import numpy as np
import pytest
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")

import mpistrat as ms  # noqa: E402
import mpistrat.horovod as hvd  # noqa: E402
from mpistrat.horovod.distributed_optimizer import _restore_h5_optimizer  # noqa: E402

pytestmark = [pytest.mark.numpy_only("Keras and NumPy values built here, whatever the kind"),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason=(
                  "Horovod Keras programs run at 1-3 ranks (widths 1, 2 and an odd one); at 4 "
                  "the same engine paths run in the other suites"))]

BATCH, STEPS, LR = 8, 2, 0.05


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """One directory for all ranks (rank 0 picks it)."""
    path = str(tmp_path_factory.mktemp("hvdloops")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def data(ranks):
    """``STEPS`` batches of ``BATCH`` rows for each of ``ranks`` ranks."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((ranks * STEPS * BATCH, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2)) + 0.2).astype(np.float32)
    return x, y


def rows(rank, step, ranks):
    """Rank ``rank``'s rows of its batch ``step`` (its own contiguous block of the data)."""
    start = (rank * STEPS + step) * BATCH
    return slice(start, start + BATCH)


def mine(rank, ranks):
    return slice(rank * STEPS * BATCH, (rank + 1) * STEPS * BATCH)


def build(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(2)])


def values(variables):
    return [np.asarray(v.value) for v in variables]


def gradient(model, x, y, weights=None):
    """The gradient of the mean squared error at ``weights`` (default: the model's)."""
    import jax
    import jax.numpy as jnp
    trainable = [jnp.asarray(w) for w in (weights if weights is not None else
                                          values(model.trainable_variables))]
    fixed = [v.value for v in model.non_trainable_variables]

    def loss(tv):
        pred, _ = model.stateless_call(tv, fixed, x, training=True)
        return jnp.mean((pred - y) ** 2)
    return [np.asarray(g) for g in jax.grad(loss)(trainable)]


def combine(per_rank, op=hvd.Average):
    total = [np.sum(np.stack(gs), axis=0) for gs in zip(*per_rank)]
    return total if op == hvd.Sum else [t / np.float32(len(per_rank)) for t in total]


def same_on_every_rank(arrays):
    gathered = hvd.allgather_object([np.asarray(a) for a in arrays])
    for other in gathered:
        for a, b in zip(other, gathered[0]):
            np.testing.assert_array_equal(a, b)


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# -- custom loops --------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_apply_gradients_in_a_custom_loop_applies_the_ranks_reduced_gradients(world, op):
    """Each rank its own batch; after STEPS steps the weights are one process's applying the
    mean (op=Sum: the sum) of the ranks' gradients, on every rank (before: each rank applied
    its own and the replicas drifted)."""
    n, r = world.size, world.rank
    x, y = data(n)
    model = build()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9), op=op)
    reference = build()
    alone = keras.optimizers.SGD(LR, momentum=0.9)
    for step in range(STEPS):
        grads = gradient(model, x[rows(r, step, n)], y[rows(r, step, n)])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        per_rank = [gradient(reference, x[rows(k, step, n)], y[rows(k, step, n)])
                    for k in range(n)]
        alone.apply_gradients(zip(combine(per_rank, op), reference.trainable_variables))
    same_on_every_rank(values(model.weights))
    assert_close(values(model.weights), values(reference.weights))
    assert int(optimizer.iterations.value) == STEPS


def reduced(g, op, compression, predivide):
    """Horovod's reduction of ``g`` as ``hvd.allreduce`` computes it (tests/mpi/
    test_horovod_rules.py holds it to Horovod's arithmetic)."""
    if op == hvd.Average:
        return hvd.allreduce(g, op=op, prescale_factor=1.0 / predivide,
                             postscale_factor=predivide, compression=compression)
    return hvd.allreduce(g, op=op, compression=compression)


def one_variable(rank, k=0):
    """A gradient that float16 does not hold exactly, other on every rank and pass."""
    return (np.arange(5, dtype=np.float32) / 3.0 + np.float32(rank) * 0.7 + 0.011 * k) \
        .astype(np.float32)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op,compression,predivide", [
    (hvd.Average, hvd.Compression.none, 1.0), (hvd.Sum, hvd.Compression.none, 1.0),
    (hvd.Average, hvd.Compression.fp16, 1.0), (hvd.Sum, hvd.Compression.fp16, 1.0),
    (hvd.Average, hvd.Compression.none, 4.0)])
def test_apply_gradients_reduces_as_hvd_allreduce_with_the_same_options(world, op, compression,
                                                                        predivide):
    variable = keras.Variable(np.linspace(-1, 1, 5).astype(np.float32))
    start = np.asarray(variable.value)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=op,
                                         compression=compression,
                                         gradient_predivide_factor=predivide)
    g = one_variable(world.rank)
    optimizer.apply_gradients([(g, variable)])
    want = start - reduced(g, op, compression, predivide)
    np.testing.assert_array_equal(np.asarray(variable.value), want)
    if compression is hvd.Compression.fp16:   # (float16 on the wire: not the float32 result)
        assert not np.array_equal(want, start - reduced(g, op, hvd.Compression.none, 1.0))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("average", [False, True])
def test_backward_passes_sum_locally_and_apply_the_reduced_sum_every_nth_call(world, average):
    """Horovod's LocalGradientAggregationHelperEager: passes 1 and 3 change no weight (the
    iteration counts them), passes 2 and 4 apply the reduced sum of the two local gradients
    (over 2 with average_aggregated_gradients)."""
    variable = keras.Variable(np.zeros(5, np.float32))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                         average_aggregated_gradients=average)
    want = np.asarray(variable.value)
    for k in range(4):
        g = one_variable(world.rank, k)
        optimizer.apply_gradients([(g, variable)])
        if k % 2 == 0:
            held = g
        else:
            total = hvd.allreduce(held + g)   # (the local sum, then Horovod's average)
            want = want - (total / np.float32(2) if average else total)
        np.testing.assert_array_equal(np.asarray(variable.value), want)
        assert int(optimizer.iterations.value) == k + 1


@pytest.mark.mpi(min_size=1)
def test_stateless_apply_inside_jit_reduces_and_refuses_backward_passes(world):
    """Keras 3's JAX loop (``optimizer.stateless_apply`` in a jitted step) with each rank's
    batch gives one process's weights from the mean gradient."""
    import jax
    import jax.numpy as jnp
    n, r = world.size, world.rank
    x, y = data(n)
    model = build()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    optimizer.build(model.trainable_variables)
    fixed = [v.value for v in model.non_trainable_variables]

    def loss(tv, xb, yb):
        pred, _ = model.stateless_call(tv, fixed, xb, training=True)
        return jnp.mean((pred - yb) ** 2)

    @jax.jit
    def step(tv, ov, xb, yb):
        return optimizer.stateless_apply(ov, jax.grad(loss)(tv, xb, yb), tv)
    trainable, state = values(model.trainable_variables), values(optimizer.variables)
    reference = build()
    alone = keras.optimizers.Adam(0.01)
    for s in range(STEPS):
        trainable, state = step(trainable, state, x[rows(r, s, n)], y[rows(r, s, n)])
        per_rank = [gradient(reference, x[rows(k, s, n)], y[rows(k, s, n)]) for k in range(n)]
        alone.apply_gradients(zip(combine(per_rank), reference.trainable_variables))
    same_on_every_rank(trainable)
    assert_close(trainable, values(reference.trainable_variables))
    passes = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    passes.build(model.trainable_variables)
    with pytest.raises(hvd.NotSupportedError, match="backward_passes_per_step=2.*stateless"):
        passes.stateless_apply(values(passes.variables), gradient(model, x[:8], y[:8]),
                               values(model.trainable_variables))


@pytest.mark.mpi(min_size=1)
def test_optax_form_sums_backward_passes_inside_jit_and_reduces_with_op(world):
    import jax
    import jax.numpy as jnp
    import optax
    tx = hvd.DistributedOptimizer(optax.sgd(0.5), op=hvd.Sum, backward_passes_per_step=2)
    params = {"w": jnp.zeros(5, jnp.float32)}
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
        updates, s = tx.update({"w": g}, s, p)
        return optax.apply_updates(p, updates), s
    want = np.zeros(5, np.float32)
    for k in range(4):
        g = one_variable(world.rank, k)
        params, state = step(params, state, jnp.asarray(g))
        if k % 2 == 1:   # the sum over the ranks of both passes, applied on the second
            both = [one_variable(q, k - 1) + one_variable(q, k) for q in range(world.size)]
            want = want - 0.5 * np.sum(both, axis=0)
        np.testing.assert_allclose(np.asarray(params["w"]), want, rtol=1e-6, atol=1e-6)
    same_on_every_rank([params["w"]])


# -- fit -----------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op,compression,rtol", [(hvd.Sum, hvd.Compression.none, 1e-5),
                                                 (hvd.Average, hvd.Compression.fp16, 3e-3)])
def test_fit_reduces_once_by_horovods_rules(world, op, compression, rtol):
    """op=Sum in fit: each step applies the sum of the ranks' gradients once (a second
    reduction would multiply it by the number of ranks); fp16 on the wire stays within
    float16's rounding of the average."""
    n, r = world.size, world.rank
    x, y = data(n)
    model = build()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=op,
                                                     compression=compression), loss="mse")
    model.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    reference = build()
    alone = keras.optimizers.SGD(LR)
    for s in range(STEPS):
        per_rank = [gradient(reference, x[rows(k, s, n)], y[rows(k, s, n)]) for k in range(n)]
        alone.apply_gradients(zip(combine(per_rank, op), reference.trainable_variables))
    same_on_every_rank(values(model.weights))
    assert_close(values(model.weights), values(reference.weights), rtol=rtol, atol=rtol / 10)


@pytest.mark.mpi(min_size=1)
def test_fit_refuses_backward_passes_by_name_before_training(world):
    n, r = world.size, world.rank
    x, y = data(n)
    model = build()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR),
                                                     backward_passes_per_step=2), loss="mse")
    before = values(model.weights)
    with pytest.raises(hvd.NotSupportedError, match=r"model.fit with hvd.DistributedOptimizer"
                                                    r"\(backward_passes_per_step=2\)"):
        model.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(before, values(model.weights)):
        np.testing.assert_array_equal(a, b)


# -- the broadcast after the first batch ---------------------------------------------------------

def distinctive(model, rank):
    """Weights no other rank has (what rank ``rank`` loaded on its own)."""
    for i, variable in enumerate(model.weights):
        variable.assign(np.asarray(variable.value) * 0.5 + 0.1 * (rank + 1) * (i + 1))


@pytest.mark.mpi(min_size=1)
def test_ranks_keep_their_weights_at_compile_and_take_the_roots_after_the_first_batch(world):
    """Horovod's order: compile broadcasts nothing; batch 0 runs on each rank's own weights
    and every rank applies the average of those gradients; then the root's model and
    optimizer replace the others'; batch 1 runs on the root's. So every rank ends as one
    process starting from the root's weights, applying first the mean of the gradients the
    ranks computed at their own weights, then the mean at the shared ones."""
    n, r = world.size, world.rank
    root = min(1, n - 1)
    x, y = data(n)
    model = build(seed=r)                          # every rank its own start
    if r == root:
        distinctive(model, r)
    start = values(model.weights)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)),
                  loss="mse")
    for a, b in zip(start, values(model.weights)):   # nothing broadcast at compile
        np.testing.assert_array_equal(a, b)
    first = hvd.allgather_object(gradient(model, x[rows(r, 0, n)], y[rows(r, 0, n)]))
    roots_start = hvd.broadcast_object(start, root)
    model.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root)])
    reference = build()
    reference.set_weights(roots_start)
    alone = keras.optimizers.SGD(LR, momentum=0.9)
    alone.apply_gradients(zip(combine(first), reference.trainable_variables))
    second = [gradient(reference, x[rows(k, 1, n)], y[rows(k, 1, n)]) for k in range(n)]
    alone.apply_gradients(zip(combine(second), reference.trainable_variables))
    same_on_every_rank(values(model.weights) + values(model.optimizer.variables))
    assert_close(values(model.weights), values(reference.weights))
    assert_close(values(model.optimizer.variables), values(alone.variables))


@pytest.mark.mpi(min_size=2)
def test_ranks_that_start_apart_without_the_broadcast_callback_raise_by_name(world):
    n, r = world.size, world.rank
    x, y = data(n)
    model = build(seed=r)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    before = values(model.weights)
    with pytest.raises(ValueError, match=r"start from different weights \(rank\(s\) 1"
                                         r".*BroadcastGlobalVariablesCallback"):
        model.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(before, values(model.weights)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_h5_resume_on_rank_0_trains_on_from_rank_0s_model_and_optimizer(world, shared_dir):
    """Horovod's resume: rank 0 ``hvd.load_model``s a legacy .h5 (SGD with momentum slots),
    the other ranks build and compile afresh (their SGD has no slots until fit builds it).
    Before, the broadcast at the start of training met 34 variables on one rank and 54 on
    another; now it follows the first batch, when every optimizer is built."""
    n, r = world.size, world.rank
    x, y = data(n)
    path = os.path.join(shared_dir, "resume.h5")
    trained = build()                                 # (Keras 3 reads no "mse" from an .h5)
    trained.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)),
                    loss=keras.losses.MeanSquaredError())
    trained.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, shuffle=False,
                verbose=0)
    if r == 0:
        trained.save(path)
    world.comm.Barrier()
    if r == 0:
        model = hvd.load_model(path)
    else:
        model = build(seed=10 + r)
        model.compile(optimizer=hvd.DistributedOptimizer(
            keras.optimizers.SGD(LR, momentum=0.9)), loss=keras.losses.MeanSquaredError())
    first = hvd.allgather_object(gradient(model, x[rows(r, 0, n)], y[rows(r, 0, n)]))
    model.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    reference = keras.models.load_model(path)        # Keras's, its .h5 momentums put back
    _restore_h5_optimizer(reference, path)
    alone = reference.optimizer
    assert int(alone.iterations.value) == STEPS
    alone.apply(combine(first), reference.trainable_variables)
    second = [gradient(reference, x[rows(k, 1, n)], y[rows(k, 1, n)]) for k in range(n)]
    alone.apply(combine(second), reference.trainable_variables)
    same_on_every_rank(values(model.weights) + values(model.optimizer.variables))
    assert_close(values(model.weights), values(reference.weights))
    assert_close(values(model.optimizer.variables), values(alone.variables))
    assert int(model.optimizer.iterations.value) == 2 * STEPS


# -- generators ------------------------------------------------------------------------------

def batches(x, y, count):
    for k in range(count):
        yield x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]


@pytest.mark.mpi(min_size=1)
def test_generators_of_equal_length_train_as_the_arrays_do(world):
    n, r = world.size, world.rank
    x, y = data(n)
    models = []
    for source in ("generator", "arrays"):
        model = build()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
        xs, ys = x[mine(r, n)], y[mine(r, n)]
        if source == "generator":
            history = model.fit(batches(xs, ys, STEPS), epochs=1, verbose=0)
        else:
            history = model.fit(xs, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        models.append((model, history.history["loss"]))
    (generator, g_loss), (arrays, a_loss) = models
    same_on_every_rank(values(generator.weights))
    assert_close(values(generator.weights), values(arrays.weights), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g_loss, a_loss, rtol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_generators_of_different_lengths_raise_on_every_rank_naming_each_count(world):
    """Before, the rank whose generator ran dry left fit and the others waited forever in
    the gradient all-reduce."""
    n, r = world.size, world.rank
    rng = np.random.default_rng(r)
    count = 3 + r                                   # rank 0: 3 batches, rank 1: 4, ...
    x = rng.standard_normal((count * BATCH, 4)).astype(np.float32)
    y = rng.standard_normal((count * BATCH, 2)).astype(np.float32)
    model = build()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    others = ", ".join(f"rank {k}: more than 3" for k in range(1, n))
    with pytest.raises(ValueError, match=f"different numbers of batches \\(rank 0: 3, "
                                         f"{others}\\)"):
        model.fit(batches(x, y, count), epochs=1, verbose=0)
    same_on_every_rank(values(model.weights))         # nothing trained apart


# -- BackupAndRestore on rank 0 only ---------------------------------------------------------

class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted at epoch 2")


def resumable(seed):
    model = build(seed)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)),
                  loss="mse")
    return model


@pytest.mark.mpi(min_size=2)
def test_backup_and_restore_on_rank_0_only_resumes_every_rank_at_rank_0s_epoch(world,
                                                                              shared_dir):
    """Horovod's rank-0 pattern: rank 0 restores epoch 2 from its backup; every rank then
    takes rank 0's epoch, weights and optimizer (before: rank 0 resumed at epoch 2, the
    others at 0, and the job hung). The resumed run ends as an uninterrupted one."""
    n, r = world.size, world.rank
    x, y = data(n)
    xs, ys = x[mine(r, n)], y[mine(r, n)]
    backup = os.path.join(shared_dir, "backup")

    def fit(model, callbacks):
        if r == 0:
            callbacks = [keras.callbacks.BackupAndRestore(backup)] + callbacks
        return model.fit(xs, ys, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                         callbacks=callbacks)
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        fit(resumable(0), [Interrupt()])
    resumed = resumable(seed=r)                     # rank 1 afresh, from other weights
    history = fit(resumed, [])
    assert len(history.history["loss"]) == 2        # epochs 2 and 3, on every rank
    whole = resumable(0)
    whole.fit(xs, ys, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    same_on_every_rank(values(resumed.weights))
    assert_close(values(resumed.weights), values(whole.weights), rtol=1e-6, atol=1e-7)
    assert_close(values(resumed.optimizer.variables), values(whole.optimizer.variables),
                 rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=2)
def test_backup_and_restore_given_elsewhere_but_not_on_rank_0_is_refused_by_name(world,
                                                                                shared_dir):
    n, r = world.size, world.rank
    x, y = data(n)
    model = resumable(0)
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(shared_dir, "b1"))] \
        if r == 1 else []
    with pytest.raises(ValueError, match=r"BackupAndRestore is given on rank\(s\) 1 but not on "
                                         r"rank 0"):
        model.fit(x[mine(r, n)], y[mine(r, n)], batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=callbacks)
