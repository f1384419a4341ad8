"""``Strategy.reduce`` of one scalar (a Python float or a NumPy scalar of a foldable dtype)
takes the engine's scalar hot path (``CollectiveEngine.reduce_scalar``): the same values and
types as the long path, the same agreement with ranks that take the long path, and the same
error on every rank when ranks disagree."""

import math

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine, algorithms
from mpistrat.collectives.validation import PAYLOAD_SLOTS
from mpistrat.errors import InvalidArgumentError
from mpistrat.runtime import timeline

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.uint8,
          np.uint16, np.uint32]


def _value(dtype, rank):
    """A value per rank that is exact in ``dtype`` (and odd, so integer MEANs truncate)."""
    if np.dtype(dtype).kind == "f":
        return dtype(0.25 * (rank + 1) + 3.0)   # dyadic: every sum exact in float64
    return dtype(2 * rank + 3 if np.dtype(dtype).kind == "u" else -(2 * rank + 3))


def _long_path(engine, value, op):
    """``value``'s all-reduce by the long path: padded past what the probe holds (11
    values), reduced element-wise, cut back to its shape."""
    value = np.asarray(value)
    padded = np.zeros(PAYLOAD_SLOTS + 1, value.dtype)
    padded[:value.size] = value.reshape(-1)
    return engine.all_reduce(padded, op)[:value.size].reshape(value.shape)


def _expected(dtype, op, values):
    total = math.fsum(float(v) for v in values)
    if op == "MEAN":
        total = total / len(values)
        if np.dtype(dtype).kind in "iu":
            total = math.trunc(total)
    return dtype(total)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN", ms.ReduceOp.SUM, "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_scalars_keep_their_type_and_value(world, op, dtype):
    strategy = ms.MultiWorkerMirroredStrategy()
    values = [_value(dtype, r) for r in range(world.size)]
    name = op.name if isinstance(op, ms.ReduceOp) else op.upper()
    got = strategy.reduce(op, values[world.rank], axis=None)
    want = _expected(dtype, name, values)
    assert type(got) is dtype and got == want, (got, want)
    # the long path (an array of one value, reshaped) gives the same bits
    long = strategy.reduce(op, np.array([values[world.rank]]), axis=None)
    assert long.dtype == dtype and long[0] == got


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("value", [np.int8(100), np.uint8(200), np.int32(2**31 - 1),
                                   np.uint32(2**32 - 1), np.int16(-30000)])
def test_integer_sums_beyond_the_dtype_wrap_as_the_long_path(world, value):
    strategy = ms.MultiWorkerMirroredStrategy()
    fast = strategy.reduce("SUM", value, axis=None)
    long = _long_path(strategy.extended.engine, value, "SUM")[()]
    assert type(fast) is type(value) and fast == long
    bits = 8 * value.dtype.itemsize          # MPI's integer SUM wraps modulo 2**bits
    wrapped = (int(value) * world.size) % (1 << bits)
    assert int(fast.astype(f"u{value.dtype.itemsize}")) == wrapped
    array = strategy.reduce("SUM", np.array([value, value]), axis=None)  # the small path
    assert array.dtype == value.dtype and (array == fast).all()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_python_floats_and_the_timeline(world, op):
    strategy = ms.MultiWorkerMirroredStrategy()
    value = 0.25 * world.rank + 1.0   # dyadic: every sum exact
    want = math.fsum(0.25 * r + 1.0 for r in range(world.size))
    want = want / world.size if op == "MEAN" else want
    got = strategy.reduce(op, value, axis=None)
    assert type(got) is np.float64 and got == want
    with timeline.recording() as events:  # recorded: the long path, the same result
        again = strategy.reduce(op, value, axis=None)
    assert type(again) is np.float64 and again == got
    assert any("all_reduce" in str(e) for e in events)


@pytest.mark.mpi(min_size=2)
def test_hot_path_meets_the_long_path_on_other_ranks(world):
    """Rank 0 reduces through the strategy (hot path), the others through the engine's
    all_reduce (the long path): one collective, the same sum everywhere."""
    strategy = ms.MultiWorkerMirroredStrategy()
    engine = strategy.extended.engine
    value = np.float32(world.rank + 0.5)
    got = strategy.reduce("SUM", value, axis=None) if world.rank == 0 else \
        engine.all_reduce(value, "SUM")[()]
    assert got == np.float32(sum(r + 0.5 for r in range(world.size)))
    assert got.dtype == np.float32


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_raise_together(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    value = np.float32(1.0) if world.rank == 0 else np.float64(1.0)
    with pytest.raises(InvalidArgumentError, match="rank 0 has float32"):
        strategy.reduce("SUM", value, axis=None)
    op = "SUM" if world.rank == 0 else "MEAN"
    with pytest.raises(InvalidArgumentError, match="different collectives"):
        strategy.reduce(op, 1.0, axis=None)
    assert strategy.reduce("SUM", 2.0, axis=None) == 2.0 * world.size  # still usable


@pytest.mark.mpi(min_size=1)
def test_what_does_not_fold_takes_the_long_path(world):
    engine = CollectiveEngine(world.comm)
    assert engine.reduce_scalar("MAX", 1.0) is None
    assert engine.reduce_scalar("SUM", np.int64(1)) is None      # int64 sums may not be exact
    assert engine.reduce_scalar("SUM", np.ones(11)) is None      # more than the probe holds
    assert engine.reduce_scalar("SUM", np.array(1.0)) is None    # 0-d: scalars come back
    assert engine.reduce_scalar("SUM", np.ones(2, np.int64)) is None
    assert engine.reduce_scalar(["SUM"], 1.0) is None            # unhashable: named elsewhere
    strategy = ms.MultiWorkerMirroredStrategy()
    assert strategy.reduce("MAX", float(world.rank), axis=None) == world.size - 1
    assert strategy.reduce("SUM", np.int64(2), axis=None) == 2 * world.size
    with pytest.raises(ValueError, match="unknown reduce op"):
        strategy.reduce("AVERAGE", 1.0, axis=None)


@pytest.mark.mpi(min_size=1)
def test_count_ranks_is_the_float64_sum_of_the_flags(world):
    """The datasets' per-step lockstep (``count_ranks``) counts each flag over ranks, meets
    ranks that all-reduce the same flags as an array, and refuses a different flag count."""
    engine = CollectiveEngine(world.comm)
    flags = [world.rank == 0, True, world.rank % 2 == 1]
    for _ in range(2):  # the first call makes the ready probe, the second uses it
        counts = engine.count_ranks(flags)
        assert list(counts) == [1.0, float(world.size), float(world.size // 2)]
    if world.size == 1:
        return
    mixed = engine.count_ranks(flags) if world.rank == 0 else \
        engine.all_reduce(np.array(flags, np.float64), "SUM")
    assert list(mixed) == [1.0, float(world.size), float(world.size // 2)]
    with pytest.raises(InvalidArgumentError, match="tensor 0"):
        engine.count_ranks(flags if world.rank == 0 else flags[:2])
    assert list(engine.count_ranks([True])) == [float(world.size)]  # still usable


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_arrays_ride_in_the_probe_with_the_long_paths_values(world, op, dtype):
    """A NumPy array of at most 10 values: the same values, dtype and shape as the long path
    (padded past the probe) and a new array each time (the probe's buffers are reused)."""
    strategy = ms.MultiWorkerMirroredStrategy()
    engine = strategy.extended.engine
    mine = np.array([[_value(dtype, world.rank + k) for k in range(3)] for _ in range(2)],
                    dtype=dtype)
    fast = strategy.reduce(op, mine, axis=None)
    long = _long_path(engine, mine, op)
    assert fast.dtype == dtype and fast.shape == (2, 3)
    np.testing.assert_array_equal(fast, long)
    columns = [[_value(dtype, r + k) for r in range(world.size)] for k in range(3)]
    np.testing.assert_array_equal(fast[0], [_expected(dtype, op, c) for c in columns])
    again = strategy.reduce(op, mine, axis=None)
    assert again is not fast
    np.testing.assert_array_equal(fast, again)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.uint8])
@pytest.mark.parametrize("shape", [(8,), (2, 3), (1,)])
def test_small_array_means_are_the_long_path_bits_and_new_arrays(world, dtype, shape):
    """A small array's SUM and MEAN through the probe: summed exactly in float64, a MEAN
    divided there, rounded once into the dtype (integers: the long path's bits); each result is an array of its own, which the next call does not
    overwrite."""
    strategy = ms.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(world.rank)
    value = (rng.standard_normal(shape) * 100).astype(dtype)
    if dtype is np.float64:   # MPI sums float64 in float64: dyadic values, exact in any order
        value = rng.integers(-400, 400, shape) / 4.0
    everyone = np.stack(world.comm.allgather(value)).reshape(world.size, -1)
    for op in ("MEAN", "SUM"):
        got = strategy.reduce(op, value, axis=None)
        assert got.dtype == np.dtype(dtype) and got.shape == shape
        if np.dtype(dtype).kind == "f":
            exact = np.array([math.fsum(float(v) for v in column) for column in everyone.T])
            want = (exact / world.size if op == "MEAN" else exact).astype(dtype)
        else:
            want = _long_path(strategy.extended.engine, value, op)
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8),
                                      want.reshape(-1).view(np.uint8))
        kept = got.copy()
        strategy.reduce(op, value + 1, axis=None)        # the same probe, other values
        np.testing.assert_array_equal(got, kept)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(), (3,)])
def test_jax_losses_take_the_hot_path_and_keep_their_device_and_commitment(world, shape):
    """A JAX loss (0-d or a few values) is reduced through the probe: a JAX array again, of
    its dtype, with the long path's value; an uncommitted input gives an uncommitted result
    (jnp.asarray), one committed to a device a result committed to that device."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    strategy = ms.MultiWorkerMirroredStrategy()
    base = np.full(shape, 0.25 * world.rank + 1.0, np.float32)   # dyadic: exact sums
    want = np.full(shape, sum(0.25 * r + 1.0 for r in range(world.size)) / world.size,
                   np.float32)
    device = jax.devices()[0]
    for value, committed in ((jnp.asarray(base), False), (jax.device_put(base, device), True)):
        got = strategy.reduce("MEAN", value, axis=None)
        assert isinstance(got, jax.Array) and got.dtype == jnp.float32 and got.shape == shape
        assert got.committed is committed and got.devices() == {device}
        np.testing.assert_array_equal(np.asarray(got), want)
        long = strategy.extended.engine.all_reduce(value, "MEAN")      # the long path
        assert isinstance(long, jax.Array) and long.committed is committed
        np.testing.assert_array_equal(np.asarray(long), want)
    wide = jnp.zeros(64, jnp.float32)                               # too many values: long path
    np.testing.assert_array_equal(np.asarray(strategy.reduce("SUM", wide, axis=None)),
                                  np.zeros(64, np.float32))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", [float, np.float32, np.int32, np.float16])
def test_a_collective_timeout_keeps_losses_small_arrays_and_flags_in_the_probe(world,
                                                                                monkeypatch, kind):
    """With a collective timeout a loss, a small array and the flags still ride in the probe,
    one collective waited for within the timeout (its hash says it is timed): the long path's
    values, meeting ranks on the long path, and a clear error where only one rank is timed."""
    monkeypatch.setenv("MPISTRAT_COLLECTIVE_TIMEOUT", "60")
    engine = CollectiveEngine(world.comm)
    value = kind(0.5 * world.rank + 3) if kind is float or np.dtype(kind).kind == "f" \
        else kind(world.rank + 3)
    want = _long_path(engine, value, "MEAN")[()]
    fast = engine.reduce_scalar("MEAN", value)
    assert (fast is not None) == (world.size > 1), fast
    if world.size == 1:
        return
    assert type(fast) is (np.float64 if kind is float else kind) and fast == want, (fast, want)
    mixed = engine.reduce_scalar("MEAN", value) if world.rank == 0 else \
        engine.all_reduce(np.asarray(value), "MEAN")[()]
    assert mixed == want
    small = np.full((2, 3), value)
    np.testing.assert_array_equal(engine.reduce_scalar("SUM", small),
                                  _long_path(engine, small, "SUM"))
    assert list(engine.count_ranks([world.rank == 0, True])) == [1.0, world.size]
    monkeypatch.delenv("MPISTRAT_COLLECTIVE_TIMEOUT")
    untimed = CollectiveEngine(world.comm)
    with pytest.raises(InvalidArgumentError, match="only rank 0 set a collective timeout"):
        (engine if world.rank == 0 else untimed).reduce_scalar("MEAN", value)
    assert engine.reduce_scalar("MEAN", value) == want   # still usable


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX", "MIN"])
@pytest.mark.parametrize("kind", [float, np.float64, np.float32, np.int32, np.uint8,
                                  np.float16])
def test_validation_off_scalars_take_the_long_paths_call_and_values(world, monkeypatch, op,
                                                                    kind):
    """With MPISTRAT_VALIDATE=0 a scalar is one blocking Allreduce in its own dtype: the
    long path's call (rank 0 here meets the others on the long path) and its bits."""
    monkeypatch.setenv("MPISTRAT_VALIDATE", "0")
    engine = CollectiveEngine(world.comm)
    value = kind(0.25 * world.rank + 1.5) if kind is float or np.dtype(kind).kind == "f" \
        else kind(world.rank + 3)
    want = engine.all_reduce(np.array([value]), op)[0]      # the long path
    fast = engine.reduce_scalar(op, value)
    narrow = kind is not float and np.dtype(kind).kind in "iu" and np.dtype(kind).itemsize < 4
    takes = world.size > 1 and kind is not np.float16 and not (
        op == "MEAN" and np.dtype(kind).kind in "iu") and not (
        op == "SUM" and narrow)                            # (whose wire is another dtype)
    assert (fast is not None) == takes, fast
    if takes:
        assert type(fast) is (np.float64 if kind is float else kind)
        assert fast.tobytes() == want.tobytes(), (fast, want)
        mixed = engine.reduce_scalar(op, value) if world.rank == 0 else \
            engine.all_reduce(np.asarray(value), op)[()]
        assert mixed.tobytes() == want.tobytes()
    ring = CollectiveEngine(world.comm, ms.CommunicationOptions(algorithm="ring"))
    assert ring.reduce_scalar(op, value) is None           # the algorithm asked for runs
    monkeypatch.setattr(algorithms, "RING_THRESHOLD_BYTES", 0)   # the ring from 0 bytes
    assert CollectiveEngine(world.comm).reduce_scalar(op, value) is None
    monkeypatch.undo()
    monkeypatch.setenv("MPISTRAT_VALIDATE", "0")
    monkeypatch.setenv("MPISTRAT_COLLECTIVE_TIMEOUT", "60")  # timed: the long path only
    assert CollectiveEngine(world.comm).reduce_scalar(op, value) is None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16])
def test_validation_off_small_arrays_and_flags_take_the_long_paths_call(world, monkeypatch, op,
                                                                        dtype):
    monkeypatch.setenv("MPISTRAT_VALIDATE", "0")
    engine = CollectiveEngine(world.comm)
    array = (np.arange(8).reshape(2, 4) * 0.75 + world.rank).astype(dtype)[:, ::-1]  # strided
    want = engine.all_reduce([array], op)[0]                 # the long path
    fast = engine.reduce_scalar(op, array)
    takes = world.size > 1 and dtype is not np.float16 and not (
        op == "MEAN" and np.dtype(dtype).kind == "i")
    assert (fast is not None) == takes, fast
    if takes:
        assert fast.dtype == dtype and fast.shape == (2, 4) and fast is not array
        assert fast.tobytes() == want.tobytes()
        mixed = engine.reduce_scalar(op, array) if world.rank == world.size - 1 else \
            engine.all_reduce([array], op)[0]
        assert mixed.tobytes() == want.tobytes()
    flags = [world.rank == 0, True, False]
    assert list(engine.count_ranks(flags)) == [1.0, world.size, 0.0]
    jnp = pytest.importorskip("jax.numpy")   # JAX keeps the long path (its backend may be NCCL)
    assert engine.reduce_scalar(op, jnp.asarray(array)) is None
