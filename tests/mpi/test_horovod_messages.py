"""mpistrat.horovod's messages name the cause (issue 43):

* ``MetricAverageCallback`` after a callback that adds logs on rank 0 only raises on every rank,
  naming that callback, the ranks it runs on and each rank's log keys (before: "ranks disagree
  on tensor 0");
* ``fit``/``evaluate`` on an ``ms.data.Dataset`` under ``hvd`` (a model compiled with
  ``DistributedOptimizer``) is accepted: each rank iterates its own dataset (Horovod's contract,
  per-rank data) and the result is that of the same rows given as arrays; datasets of different
  lengths raise on every rank naming each rank's count (before: Keras's "Unrecognized data
  type");
* ``validation_steps`` larger than the batches every rank has says so (before: "the ranks have
  different numbers of batches (rank 0: 4, rank 1: 4)").

Keras runs at 1-3 ranks (as tests/mpi/test_keras_fit.py)."""

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
                  "Horovod Keras programs run at 1-3 ranks (widths 1, 2 and an odd one); at 4 "
                  "the same engine paths run in the other suites"))]

BATCH, STEPS = 8, 3


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


def own_rows(rank, steps=STEPS):
    """Rank ``rank``'s own ``steps`` batches of ``BATCH`` rows."""
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((steps * BATCH, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 9.0, dtype=np.float32).reshape(4, 2) + 0.5).astype(np.float32)
    return x, y


def compiled(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    return model


class AddsALog(keras.callbacks.Callback):
    """What a rank-0-only callback may do: add a log of its own."""

    def on_epoch_end(self, epoch, logs=None):
        logs["rank_0_note"] = 1.0


@pytest.mark.mpi(min_size=1)
def test_metric_average_after_a_rank_0_only_callback_names_it_and_the_keys(world):
    x, y = own_rows(world.rank)
    model = compiled()
    extra = [AddsALog()] if world.rank == 0 else []
    callbacks = extra + [hvd.callbacks.MetricAverageCallback()]
    if world.size == 1:   # one rank: nothing differs, the log is averaged over one rank
        history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
        assert history.history["rank_0_note"] == [1.0]
        return
    with pytest.raises(ValueError) as caught:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
    text = str(caught.value)
    assert "MetricAverageCallback" in text and "AddsALog (on rank(s) 0 only)" in text, text
    assert "rank 0: ['loss', 'rank_0_note']" in text and "rank 1: ['loss']" in text, text
    assert "ranks disagree on tensor" not in text


@pytest.mark.mpi(min_size=1)
def test_metric_average_after_the_rank_0_only_callback_comes_after_it_is_accepted(world):
    """Horovod's order (rank-0-only callbacks last) trains."""
    x, y = own_rows(world.rank)
    model = compiled()
    callbacks = [hvd.callbacks.MetricAverageCallback()] + \
        ([AddsALog()] if world.rank == 0 else [])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
    assert len(history.history["loss"]) == 2


@pytest.mark.mpi(min_size=1)
def test_fit_and_evaluate_on_each_ranks_own_dataset_match_its_arrays(world):
    x, y = own_rows(world.rank)
    from_dataset, from_arrays = compiled(), compiled()
    dataset = ms.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = from_dataset.fit(dataset, epochs=2, verbose=0, validation_data=dataset,
                               callbacks=[hvd.callbacks.MetricAverageCallback()])
    want = from_arrays.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                           validation_data=(x, y),
                           callbacks=[hvd.callbacks.MetricAverageCallback()])
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(history.history[key], want.history[key], rtol=1e-5)
    for a, b in zip(from_dataset.weights, from_arrays.weights):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-5,
                                   atol=1e-6)
    everyone = hvd.allgather_object([np.asarray(w.value) for w in from_dataset.weights])
    for other in everyone:
        for a, b in zip(other, everyone[0]):
            np.testing.assert_array_equal(a, b)
    assert from_dataset.evaluate(dataset, verbose=0) == pytest.approx(
        from_arrays.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


@pytest.mark.mpi(min_size=2)
def test_own_datasets_of_different_lengths_raise_naming_each_ranks_count(world):
    steps = STEPS + (1 if world.rank == world.size - 1 else 0)
    x, y = own_rows(world.rank, steps)
    model = compiled()
    dataset = ms.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(ValueError) as caught:
        model.fit(dataset, epochs=1, verbose=0)
    text = str(caught.value)
    assert f"rank 0: {STEPS}" in text and f"rank {world.size - 1}: more than {STEPS}" in text, \
        text


@pytest.mark.mpi(min_size=1)
def test_validation_steps_beyond_every_ranks_batches_says_so(world):
    x, y = own_rows(world.rank)
    model = compiled()
    with pytest.raises(ValueError) as caught:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x, y),
                  validation_steps=STEPS + 2)
    text = str(caught.value)
    assert f"validation_steps={STEPS + 2} is larger than the {STEPS} batches every rank has" \
        in text, text
    assert "different numbers of batches" not in text, text


@pytest.mark.mpi(min_size=2)
def test_validation_steps_with_unequal_batches_still_names_each_ranks_count(world):
    x, y = own_rows(world.rank)
    vx, vy = own_rows(world.rank, STEPS + world.rank)
    model = compiled()
    with pytest.raises(ValueError) as caught:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(vx, vy),
                  validation_steps=STEPS + 1)
    text = str(caught.value)
    assert "different numbers of batches" in text and f"rank 0: {STEPS}" in text, text
