"""Every dtype users train with, and every kind and structure, through every collective.

bfloat16 and the ``ml_dtypes`` float8 types (MPI has none of them) combine in float32 and
round once; results come back as the kind of array given (NumPy, JAX on its device), with
its dtype, for both axis rules; JAX pytrees are structure. Refusals are agreed on every
rank before any data moves. Values are of the run's kind (``arrays``) unless a test says.
"""

from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine, algorithms

LOW_FLOATS = [np.float16, ml_dtypes.bfloat16] + [
    getattr(ml_dtypes, name) for name in sorted(dir(ml_dtypes))
    if name.startswith(("float8_", "float6_", "float4_"))]
LOW_IDS = [np.dtype(t).name for t in LOW_FLOATS]


def engine_for(world, **options):
    return CollectiveEngine(world.comm, ms.CommunicationOptions(**options))


@pytest.fixture
def held(arrays):
    """``arrays``, after skipping the dtypes the run's kind cannot hold (JAX on CPU has no
    float6/float4 arrays)."""
    def check(dtype):
        try:
            arrays.numpy(arrays.asarray(np.ones(2, np.float32).astype(dtype)) + 0)
        except Exception as err:  # the library's own refusal, whatever its class
            pytest.skip(f"{arrays.kind} arrays cannot hold {np.dtype(dtype).name}: {err}"[:200])
        return arrays
    return check


def values_of(rank: int, dtype) -> np.ndarray:
    """Small values every listed type holds exactly (powers of two for float8_e8m0fnu)."""
    if np.dtype(dtype).name == "float8_e8m0fnu":
        base = np.array([1.0, 2.0, 0.5, 4.0]) * 2.0 ** (rank % 2)
    else:
        base = np.array([1.0, -2.0, 0.5, 3.0]) * (1 + rank % 2) + rank % 3 * 0.5
    return base.astype(np.float32).astype(dtype)


def expected(op: str, n: int, dtype) -> np.ndarray:
    """The reduction over ranks in float32, rounded once to ``dtype``."""
    every = np.stack([values_of(k, dtype).astype(np.float32) for k in range(n)])
    combined = {"SUM": every.sum(0), "MEAN": every.sum(0) / np.float32(n), "MAX": every.max(0),
                "MIN": every.min(0)}[op]
    return combined.astype(np.float32).astype(dtype)


class _HostArrays:
    """``same_bits``' view of results that are NumPy whatever the run's kind."""
    kind = "numpy"

    @staticmethod
    def numpy(value):
        return np.asarray(value)


HOST = _HostArrays()


def same_bits(actual, want, arrays) -> None:
    got = arrays.numpy(actual)
    assert got.dtype == np.dtype(want.dtype), (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


# -- 1. bfloat16 and float8 in every collective --------------------------------------------

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", LOW_FLOATS, ids=LOW_IDS)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX", "MIN"])
def test_low_precision_reduce_at_both_axis_rules(world, strategy, held, dtype, op):
    arrays = held(dtype)
    n, mine = world.size, values_of(world.rank, dtype)
    want = expected(op, n, dtype)
    same_bits(strategy.reduce(op, arrays.asarray(mine), axis=None), want, arrays)
    arrays.assert_kind(strategy.reduce(op, arrays.asarray(mine), axis=None))
    rows = strategy.reduce(op, arrays.asarray(mine[None, :]), axis=0)  # one row per replica
    arrays.assert_kind(rows)
    same_bits(rows, want, arrays)
    ctx_out = strategy.run(lambda: ms.get_replica_context().all_reduce(op, arrays.asarray(mine)))
    same_bits(ctx_out, want, arrays)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", LOW_FLOATS, ids=LOW_IDS)
def test_low_precision_fused_ring_gather_and_batch_reduce(world, strategy, held, dtype):
    arrays = held(dtype)
    n, r = world.size, world.rank
    mine = values_of(r, dtype)
    many = {f"g{i}": arrays.asarray(mine) for i in range(5)}  # small tensors: one fused bucket
    out = engine_for(world).all_reduce(many, "SUM")
    for value in out.values():
        same_bits(value, expected("SUM", n, dtype), arrays)
    ring = engine_for(world, algorithm="ring").all_reduce(arrays.asarray(np.tile(mine, 64)),
                                                          "MEAN")
    same_bits(ring, np.tile(expected("MEAN", n, dtype), 64), arrays)
    pairs = [(arrays.asarray(mine), "/cpu:0"), (arrays.asarray(mine[:2]), "/cpu:0")]
    batch = strategy.extended.batch_reduce_to("MAX", pairs)
    same_bits(batch[0], expected("MAX", n, dtype), arrays)
    same_bits(batch[1], expected("MAX", n, dtype)[:2], arrays)
    gathered = strategy.gather(arrays.asarray(mine[None, :]), axis=0)
    arrays.assert_kind(gathered)
    same_bits(gathered, np.stack([values_of(k, dtype) for k in range(n)]), arrays)
    root = engine_for(world).broadcast(arrays.asarray(values_of(r, dtype)), root=0)
    same_bits(root, values_of(0, dtype), arrays)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", LOW_FLOATS, ids=LOW_IDS)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_low_precision_reproducible_sums(world, held, dtype, op):
    arrays = held(dtype)
    strategy = ms.MultiWorkerMirroredStrategy(
        communication_options=ms.CommunicationOptions(deterministic=True))
    n, mine = world.size, values_of(world.rank, dtype)
    same_bits(strategy.reduce(op, arrays.asarray(mine), axis=None), expected(op, n, dtype),
              arrays)
    rows = strategy.reduce(op, arrays.asarray(mine[None, :]), axis=0)
    arrays.assert_kind(rows)
    same_bits(rows, expected(op, n, dtype), arrays)


# -- 2. types round-trip: kinds, dtypes, structures ----------------------------------------

class Pair(NamedTuple):
    w: object
    b: object


def pytree_values(xp):
    """Registered JAX pytree nodes of several sorts, holding arrays of the module ``xp``."""
    import jax
    from flax import nnx, struct

    @struct.dataclass
    class Params:
        kernel: object
        bias: object

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(xp.ones((2, 3), dtype=xp.float32))
            self.b = nnx.Param(xp.zeros(3, dtype=xp.float32))

    @jax.tree_util.register_pytree_node_class
    class Box:
        def __init__(self, inside):
            self.inside = inside

        def tree_flatten(self):
            return (self.inside,), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    return {"state": nnx.state(Model()),
            "struct": Params(kernel=xp.ones((2, 3), xp.float32), bias=xp.zeros(3, xp.float32)),
            "named": Pair(w=xp.ones((2, 3), xp.float32), b=xp.zeros(3, xp.float32)),
            "custom": Box(xp.ones((2, 3), xp.float32))}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("module", ["numpy", "jax"])
def test_pytree_nodes_are_structure_and_come_back_as_the_same_treedef(world, strategy, axis,
                                                                      module):
    import jax
    import jax.numpy as jnp
    xp = jnp if module == "jax" else np
    for name, value in pytree_values(xp).items():
        out = strategy.reduce("SUM", value, axis=axis)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(value), name
        for got, given in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(value)):
            assert type(got).__module__.split(".")[0] == type(given).__module__.split(".")[0]
            assert got.dtype == given.dtype, (name, got.dtype)
            want = np.asarray(given) * world.size if axis is None else \
                np.asarray(given).sum(0) * world.size
            np.testing.assert_array_equal(np.asarray(got), want)
            if module == "jax":
                assert got.devices() == given.devices()
    gathered = strategy.run(lambda: ms.get_replica_context().all_gather(
        pytree_values(xp)["state"], axis=0))
    assert jax.tree_util.tree_structure(gathered) == \
        jax.tree_util.tree_structure(pytree_values(xp)["state"])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis", [None, 0])
def test_kinds_and_dtypes_round_trip_for_both_axis_rules(world, strategy, arrays, axis):
    dtypes = [np.float32, np.float64, np.int32, np.uint8, np.int64, np.float16,
              ml_dtypes.bfloat16, np.complex64, "<i2"] + (
                  [">f8"] if arrays.kind == "numpy" else [])  # JAX holds native order only
    value = {str(np.dtype(d)) + str(i): arrays.asarray(np.ones((2, 3)), dtype=d)
             for i, d in enumerate(dtypes)}
    value["list"] = [arrays.asarray(np.ones((2, 2), np.float32))]
    value["pair"] = Pair(arrays.asarray(np.ones((2,), np.float32)),
                         arrays.asarray(np.ones((2,), np.int32)))
    for op in ("SUM", "MEAN", "MAX", "MIN"):
        if op in ("MAX", "MIN"):
            value = {k: v for k, v in value.items() if "complex" not in k}
        out = strategy.reduce(op, value, axis=axis)
        assert isinstance(out["pair"], Pair) and isinstance(out["list"], list)
        flat_in = ms.nest.flatten(value)
        flat_out = ms.nest.flatten(out)
        for given, got in zip(flat_in, flat_out):
            arrays.assert_kind(got)
            assert arrays.numpy(got).dtype == arrays.numpy(given).dtype, (op, given.dtype)
            if arrays.kind == "jax":
                assert got.devices() == given.devices()


@pytest.mark.mpi(min_size=1)
def test_mean_keeps_float32_and_integer_means_agree_at_both_axis_rules(world, strategy,
                                                                       arrays):
    n = world.size
    f32 = arrays.asarray(np.full((2, 3), world.rank, np.float32))
    out = strategy.reduce("MEAN", f32, axis=0)
    arrays.assert_equal(out, np.full(3, sum(range(n)) / n, np.float32), np.float32)
    u8 = np.full(3, 200, np.uint8)
    by_element = strategy.reduce("MEAN", arrays.asarray(u8), axis=None)
    by_rows = strategy.reduce("MEAN", arrays.asarray(u8[None, :]), axis=0)
    for got in (by_element, by_rows):
        arrays.assert_equal(got, u8, np.uint8)  # 200, never 600 % 256 / n
    odd = arrays.asarray(np.full((1, 2), [-7, 7], np.int16) * (world.rank + 1))
    want = (np.trunc(np.array([-7, 7]) * sum(range(1, n + 1)) / n)).astype(np.int16)
    arrays.assert_equal(strategy.reduce("MEAN", odd, axis=0), want, np.int16)
    arrays.assert_equal(strategy.reduce("MEAN", odd[0], axis=None), want, np.int16)


# -- 3. numbers: overflow, complex, empty bool batches, strings, big messages, byte order ----

@pytest.mark.mpi(min_size=1)
def test_deterministic_float16_mean_does_not_overflow(world, arrays):
    strategy = ms.MultiWorkerMirroredStrategy(
        communication_options=ms.CommunicationOptions(deterministic=True))
    big = arrays.asarray(np.full(4, 60000, np.float16))
    for out in (strategy.reduce("MEAN", big, axis=None),
                strategy.reduce("MEAN", big[None, :], axis=0),
                ms.MultiWorkerMirroredStrategy().reduce("MEAN", big, axis=None)):
        arrays.assert_equal(out, np.full(4, 60000, np.float16), np.float16)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["MAX", "MIN"])
@pytest.mark.parametrize("count", [3, (1 << 20) // 8 + 1])
def test_complex_min_max_is_a_type_error_at_every_size(world, strategy, arrays, op, count):
    value = arrays.asarray(np.ones(count, np.complex128))
    for axis in (None, 0):
        with pytest.raises(TypeError, match="no order for complex"):
            strategy.reduce(op, value, axis=axis)
    assert float(strategy.reduce("SUM", 1.0, axis=None)) == world.size  # nobody is stuck


@pytest.mark.mpi(min_size=1)
def test_bool_max_with_no_rows_on_one_rank(world, strategy, arrays):
    rows = 0 if world.rank == world.size - 1 else 2
    batch = arrays.asarray(np.ones((rows, 3), bool))
    most = strategy.reduce("MAX", batch, axis=0)
    least = strategy.reduce("MIN", batch, axis=0)
    everywhere_empty = world.size == 1
    arrays.assert_equal(most, np.full(3, not everywhere_empty), np.bool_)
    arrays.assert_equal(least, np.full(3, True), np.bool_)
    with pytest.raises(TypeError, match="bool"):
        strategy.reduce("SUM", batch, axis=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("strings and objects are NumPy arrays in every run")
@pytest.mark.parametrize("axis", [None, 0])
def test_strings_and_objects_are_refused_naming_the_tensor(world, strategy, axis):
    for bad in (np.array([["a", "b"]]), np.array([[1, None]], dtype=object)):
        with pytest.raises(TypeError, match=r"\['names'\]"):
            strategy.reduce("SUM", {"names": bad, "w": np.ones((1, 2))}, axis=axis)
    with pytest.raises(TypeError, match=r"\['names'\]"):
        strategy.run(lambda: ms.get_replica_context().all_gather(
            {"names": np.array([[1, None]], object)}, axis=0))
    assert float(strategy.reduce("SUM", 1.0, axis=None)) == world.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.numpy_only("strings are NumPy arrays in every run")
def test_a_string_on_one_rank_only_is_agreed_never_a_hang(world, strategy):
    value = np.array([["x", "y"]]) if world.rank == 1 else np.ones((1, 2))
    for axis in (None, 0):
        with pytest.raises((TypeError, ValueError), match="rank"):
            strategy.reduce("SUM", value, axis=axis)
    assert float(strategy.reduce("SUM", 1.0, axis=None)) == world.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("counts the host backend's MPI messages")
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_messages_split_at_the_count_limit(world, monkeypatch, algorithm):
    monkeypatch.setattr(algorithms, "MESSAGE_ELEMENTS", 1000)
    engine = engine_for(world, algorithm=algorithm)
    value = (np.arange(2500) % 100 + world.rank).astype(np.int8)
    with algorithms.recording() as log:
        out = engine.all_reduce(value, "MAX")
    np.testing.assert_array_equal(out, (np.arange(2500) % 100 + world.size - 1).astype(np.int8))
    sizes = [e[3] for e in log if e[0] == "call"] + \
        [s[2] - s[1] for e in log if e[0] == "step" for s in e[1:3] if s is not None]
    assert max(sizes, default=0) <= 1000
    if world.size > 1:
        assert len([e for e in log if e[0] == "call"]) >= 3 or algorithm == "ring"
    root = engine.broadcast(np.arange(2500, dtype=np.int16) * (world.rank + 1), root=0)
    np.testing.assert_array_equal(root, np.arange(2500, dtype=np.int16))
    rows = (np.arange(700 * (world.rank + 1), dtype=np.int32) + 1000 * world.rank)[:, None]
    gathered = engine.all_gather(np.repeat(rows, 2, axis=1), axis=0)  # > 1000 elements in all
    want = np.concatenate([np.arange(700 * (k + 1)) + 1000 * k for k in range(world.size)])
    np.testing.assert_array_equal(gathered, np.repeat(want[:, None], 2, axis=1))


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("counts the host backend's MPI messages")
def test_buffers_of_one_byte_size_split_by_their_own_counts(world, monkeypatch):
    # one call, two buckets of 8000 bytes: 1000 float64 values, then 8000 int8 ones; the
    # backend's memo of each size's algorithm must not let the second skip its split
    monkeypatch.setattr(algorithms, "MESSAGE_ELEMENTS", 1000)
    engine = engine_for(world, algorithm="mpi")
    wide = np.arange(1000, dtype=np.float64) + world.rank
    narrow = (np.arange(8000) % 50 + world.rank).astype(np.int8)
    with algorithms.recording() as log:
        out = engine.all_reduce([wide, narrow], "MAX")
    np.testing.assert_array_equal(out[0], np.arange(1000) + world.size - 1)
    np.testing.assert_array_equal(out[1], (np.arange(8000) % 50 + world.size - 1).astype(np.int8))
    sizes = [e[3] for e in log if e[0] == "call"]
    assert sizes and max(sizes) <= 1000, sizes


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("byte order is a NumPy notion")
@pytest.mark.parametrize("count", [5, (1 << 20) // 8 + 3])
def test_big_endian_arrays_of_any_size(world, strategy, count):
    value = (np.arange(count, dtype=np.float64) * (world.rank + 1)).astype(">f8")
    scale = sum(range(1, world.size + 1))
    for out, want in ((strategy.reduce("SUM", value, axis=None), np.arange(count) * scale),
                      (strategy.reduce("MAX", value[None, :], axis=0),
                       np.arange(count) * world.size)):
        assert out.dtype == np.dtype(">f8")
        np.testing.assert_array_equal(out, want)
    gathered = strategy.gather(value[None, :], axis=0)
    assert gathered.dtype == np.dtype(">f8")
    np.testing.assert_array_equal(gathered[-1], np.arange(count) * world.size)
    root = engine_for(world).broadcast(value, root=0)
    assert root.dtype == np.dtype(">f8") and root.tobytes() == np.arange(
        count, dtype=">f8").tobytes()


# -- 4. small reductions ride in the validation probe, whatever their dtype or kind --------

FOLDED = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.uint8, np.uint16,
          np.uint32]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", FOLDED, ids=[np.dtype(d).name for d in FOLDED])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_small_reductions_of_every_dtype_and_kind(world, strategy, arrays, dtype, op):
    n, r = world.size, world.rank
    mine = np.array([r + 1, 3 * (r % 2), 7], dtype=dtype)
    every = np.stack([np.array([k + 1, 3 * (k % 2), 7], dtype=np.float64) for k in range(n)])
    total = every.sum(0)
    want = (total if op == "SUM" else
            np.trunc(total / n) if np.dtype(dtype).kind in "iu" else total / n).astype(dtype)
    for value, expect in ((arrays.asarray(mine), want), (arrays.asarray(mine[2]), want[2])):
        out = strategy.reduce(op, value, axis=None)
        arrays.assert_kind(out) if arrays.kind != "numpy" else None
        assert arrays.numpy(out).dtype == np.dtype(dtype)
        np.testing.assert_array_equal(arrays.numpy(out), expect)
    scalar = strategy.reduce(op, np.dtype(dtype).type(mine[0]), axis=None)   # a NumPy scalar
    assert isinstance(scalar, np.generic) and scalar.dtype == np.dtype(dtype)
    assert scalar == want[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.numpy_only("NumPy scalars of different dtypes on different ranks")
def test_small_reductions_that_disagree_raise_on_every_rank(world, strategy):
    mine = np.float32(1.0) if world.rank == 0 else np.float64(1.0)
    with pytest.raises(ValueError, match="rank 0 has float32"):
        strategy.reduce("SUM", mine, axis=None)
    small = np.ones(3, np.float32) if world.rank == 0 else np.ones(30, np.float32)  # folds on 0
    with pytest.raises(ValueError, match="rank"):
        strategy.reduce("SUM", small, axis=None)
    assert float(strategy.reduce("SUM", np.float32(1.0), axis=None)) == world.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("NumPy stands for device memory in the device backends' logic")
def test_device_backend_logic_keeps_dtypes_with_numpy_for_device_memory(world):
    """The staged pipeline and the CUDA-aware backend (the CuPy paths, with NumPy standing
    for device memory) widen bfloat16 and a MEAN's integers as the host backend does."""
    from mpistrat.collectives.backends import CudaAwareMPI, HostMPI, StagedHostMPI
    from mpistrat.collectives.backends.pipeline import HostBufferPool, NumpyStager
    from mpistrat.collectives.reduce_op import ReduceOp
    comm, n = world.comm, world.size
    values = [values_of(world.rank, ml_dtypes.bfloat16), np.full(5, 200, np.uint8),
              np.full(3000, world.rank, ml_dtypes.float8_e4m3fn)]
    opts = ms.CommunicationOptions(bytes_per_pack=64)
    pool = HostBufferPool(lambda k: np.empty(k, np.uint8))
    for op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MAX):
        host = HostMPI().all_reduce(comm, values, op, opts, None)
        staged = StagedHostMPI().pipelined_all_reduce(comm, values, op, opts, None, np,
                                                      NumpyStager, pool, chunk_bytes=1 << 10)
        aware = CudaAwareMPI(xp=np).all_reduce(comm, values, op, opts, None)
        for got in (host, staged, aware):
            for g, v in zip(got, values):
                assert g.dtype == v.dtype and g.shape == v.shape
            same_bits(got[0], expected(op.name, n, ml_dtypes.bfloat16), HOST)
        if op is ReduceOp.MEAN:
            assert [g[1].tolist() for g in (host, staged, aware)] == [[200] * 5] * 3


# -- 5. 8- and 16-bit integer sums wrap as NumPy's do, whatever the length ---------------

NARROW_INTS = [np.int8, np.int16, np.uint8, np.uint16]


@pytest.mark.mpi(min_size=1)
@pytest.mark.numpy_only("compares with NumPy's own wrapped sums and MPI's raw call")
@pytest.mark.parametrize("dtype", NARROW_INTS, ids=[np.dtype(d).name for d in NARROW_INTS])
@pytest.mark.parametrize("count", [3, 8, 11, 64, 100_003])
def test_narrow_integer_sums_wrap_at_every_length_and_path(world, strategy, dtype, count):
    """Open MPI 4.1's vectorised SUM saturates 8- and 16-bit integers from 8 values up
    (open-mpi/ompi#8045) while shorter arrays wrap: our SUM wraps at every length, on the
    single-tensor, fused, in-place and ring paths, as NumPy's sum in the dtype does."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(count + world.rank)
    mine = rng.integers(info.max - 20 if info.min == 0 else info.min, info.max, count,
                        endpoint=True).astype(dtype)
    every = world.comm.allgather(mine)
    want = every[0].copy()
    for other in every[1:]:
        want += other                      # NumPy's arithmetic in the dtype: it wraps
    engine = strategy.extended.engine
    results = {"one tensor": engine.all_reduce(mine, "SUM"),
               "fused": engine.all_reduce([mine, np.ones(5, np.float32)], "SUM")[0],
               "ring": engine.all_reduce(mine, "SUM", ms.CommunicationOptions(algorithm="ring"))}
    into = mine.copy()
    results["in place"] = engine.all_reduce([into], "SUM", out=[into])[0]
    for path, got in results.items():
        assert got.dtype == np.dtype(dtype), path
        np.testing.assert_array_equal(got, want, err_msg=path)
