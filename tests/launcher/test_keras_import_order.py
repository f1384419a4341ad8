"""``fit`` of a Keras model compiled outside every scope is refused on every rank whichever of
Keras and the strategy comes first in a fresh process (issue 44). Before, with Keras imported
after the strategy was made and no scope entered after that, nothing installed the guard and
each rank trained its own copy apart, silently."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(   # (not imported here: the job imports it, on JAX)
    importlib.util.find_spec("keras") is None or importlib.util.find_spec("jax") is None,
    reason="needs Keras 3 and JAX")

JOB = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import mpistrat as ms

order = sys.argv[1]
if order == "keras first":
    import keras
strategy = ms.MultiWorkerMirroredStrategy()
rank = strategy.extended.local_replica_ids[0]
if order in ("strategy first", "probed first"):
    assert "keras" not in sys.modules
    if order == "probed first":   # a probe that loads nothing leaves the guard armed
        import importlib.util
        assert importlib.util.find_spec("keras") is not None and "keras" not in sys.modules
    import keras
say(rank, "finders left:", sum(type(f).__name__ == "_AfterKerasImport" for f in sys.meta_path))

keras.utils.set_random_seed(rank)        # each rank its own initial weights
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
x = np.arange(32, dtype=np.float32).reshape(8, 4) / 32
y = np.ones((8, 2), np.float32)
try:
    model.fit(x, y, batch_size=4, verbose=0)
    say(rank, "trained apart")
except ValueError as err:
    say(rank, "refused:", str(err).split(":")[0])
ms.keras.distribute_model(model, strategy)   # the fix the refusal names
model.fit(x, y, batch_size=4, verbose=0)
kernel = np.asarray(model.weights[0].value)
same = strategy.gather(kernel[None], axis=0)
say(rank, "same weights:", all(np.array_equal(k, kernel) for k in same))
"""


@pytest.mark.parametrize("order", ["strategy first", "keras first", "probed first"])
def test_fit_of_a_model_compiled_outside_the_scope_is_refused_in_either_import_order(
        launch, order):
    result = launch(2, JOB, order, limit=180)
    assert result.returncode == 0, result
    for rank in (0, 1):
        assert f"{rank} refused: Sequential 'sequential' was compiled outside " \
               f"strategy.scope() while a MultiWorkerMirroredStrategy of 2 replicas exists" \
               in result.output, result
        assert f"{rank} same weights: True" in result.output, result
        assert f"{rank} finders left: 0" in result.output, result
    assert "trained apart" not in result.output, result
