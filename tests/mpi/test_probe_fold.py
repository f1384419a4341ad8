"""Small float64 SUM/MEAN ride inside the validation probe: results, and ranks that
disagree (one folds, another would not) still raise together instead of hanging. Arrays are
of the run's kind (``arrays``, MPISTRAT_TEST_ARRAYS); Python floats stay Python floats."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine
from mpistrat.errors import InvalidArgumentError


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_scalars_and_small_float64_arrays(world, op, arrays):
    engine = CollectiveEngine(world.comm)
    n, r = world.size, world.rank
    total = sum(range(n))
    want = total if op == "SUM" else total / n
    out = engine.all_reduce(float(r), op)
    assert isinstance(out, np.ndarray) and out.shape == () and out == want
    small = engine.all_reduce(arrays.xp.arange(10, dtype=np.float64).reshape(2, 5) + r, op)
    expected = np.arange(10).reshape(2, 5) * (n if op == "SUM" else 1) + want
    arrays.assert_close(small, expected, dtype=np.float64)
    assert small.shape == (2, 5)
    scalar = ms.MultiWorkerMirroredStrategy().reduce(op, np.float64(r), axis=None)
    assert type(scalar) is np.float64 and scalar == want
    device_scalar = ms.MultiWorkerMirroredStrategy().reduce(op, arrays.asarray(float(r)), None)
    arrays.assert_close(device_scalar, want)
    again = engine.all_reduce(float(r), op)  # the engine's buffers are reused: no aliasing
    assert out == want and again == want


@pytest.mark.mpi(min_size=2)
def test_folded_and_unfolded_ranks_raise_together(world, arrays):
    engine = CollectiveEngine(world.comm)
    xp = arrays.xp
    value = 1.0 if world.rank == 0 else np.float32(1.0)  # float64 folds, float32 does not
    with pytest.raises(InvalidArgumentError, match="rank 0 has float64"):
        engine.all_reduce(value, "SUM")
    big = xp.ones(11) if world.rank == 0 else xp.ones(3)  # 11 values do not fold, 3 do
    with pytest.raises(InvalidArgumentError, match="tensor 0"):
        engine.all_reduce(big, "SUM")
    timed = ms.CommunicationOptions(timeout_seconds=30.0) if world.rank == 0 else None
    with pytest.raises(InvalidArgumentError, match="set a collective timeout"):
        engine.all_reduce(xp.ones(2), "SUM", timed)
    assert engine.all_reduce(2.0, "SUM") == 2.0 * world.size  # still usable
