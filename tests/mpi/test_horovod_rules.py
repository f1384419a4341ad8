"""mpistrat.horovod's collectives follow Horovod 0.28's rules, at any number of ranks: ``op``
and ``average`` together raise ``ValueError``; ``Average``, ``Sum``, ``Min``, ``Max`` and
``Product`` give Horovod's numbers (``Average``: the sum times ``1 / size``, integers truncated
toward zero); ``prescale_factor`` scales the input, ``postscale_factor`` the result (float32
factors, integers truncated); ``Compression.fp16`` rounds floating tensors to float16 on the
wire and returns the input's dtype; process sets other than the global one and ``Adasum`` are
refused by name. Ranks that pass different names, ops, factors or broadcast roots raise on
every rank, naming each rank's, and stay in step."""

import math

import numpy as np
import pytest

import mpistrat.horovod as hvd
from mpistrat.runtime import settings

pytestmark = pytest.mark.numpy_only("mpistrat.horovod takes and returns NumPy values")
needs_validation = pytest.mark.skipif(
    not settings.get("MPISTRAT_VALIDATE"),
    reason="names, ops and factors of tensor collectives are agreed in the validation probe")


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


def values(k, dtype):
    """Rank ``k``'s tensor: exact in every dtype below; its Sum, Min, Max and Product over 2 or
    more ranks all differ; sums of 5 and 7 at 3 ranks, where Horovod's float32 average (the sum
    times float32(1/3)) differs from the sum divided by 3."""
    return np.array([k + 1, -(k + 1), 3 - k, 1 + 2 * (k == 0), 1 + 4 * (k == 0)], dtype)


def horovod_average(total, n, dtype):
    """Horovod's Average: the sum times the postscale 1 / n (a float64), applied as its
    buffer scaling does: integers in float64 truncated toward zero, float32 times a float32."""
    scale = 1.0 / n
    if np.dtype(dtype).kind in "iu":
        return np.trunc(total.astype(np.float64) * scale).astype(dtype)
    if np.dtype(dtype) == np.float32:
        return (total * np.float32(scale)).astype(np.float32)
    return total * scale


def test_op_and_average_together_raise_value_error():
    for kwargs in ({"average": True, "op": hvd.Sum}, {"average": False, "op": hvd.Average},
                   {"average": True, "op": hvd.Average}):
        with pytest.raises(ValueError, match="op supersedes average"):
            hvd.allreduce(np.ones(2), **kwargs)
    n = hvd.size()
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), average=False), [n, n])
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), average=True), [1, 1])
    # horovod.tensorflow.keras passes the name second: a text ``average`` is refused
    with pytest.raises(TypeError, match="average='loss' is text"):
        hvd.allreduce(np.ones(2), "loss")


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
def test_each_op_gives_horovods_numbers(world, dtype):
    n = world.size
    stack = np.stack([values(k, dtype) for k in range(n)])
    mine = values(world.rank, dtype)
    total = stack.sum(axis=0, dtype=dtype)
    want = {hvd.Sum: total, hvd.Min: stack.min(axis=0), hvd.Max: stack.max(axis=0),
            hvd.Product: np.multiply.reduce(stack, axis=0, dtype=dtype),
            hvd.Average: horovod_average(total, n, dtype)}
    for op, expected in want.items():
        got = hvd.allreduce(mine, op=op, name=f"values {op}")
        assert got.dtype == np.dtype(dtype), (op, got.dtype)
        np.testing.assert_array_equal(got, expected, err_msg=op)
    np.testing.assert_array_equal(hvd.allreduce(mine), want[hvd.Average])   # the default
    if n == 3 and dtype is np.float32:   # (the rule shows: not the sum divided by 3)
        assert not np.array_equal(want[hvd.Average], total / np.float32(3))
    if n >= 2:
        assert len({want[op].tobytes() for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product)}) == 4


def test_prescale_multiplies_the_input_and_postscale_the_result_as_horovod_does(world):
    n, r = world.size, world.rank
    odd = np.array([2 * r + 1, -(2 * r + 1)], np.int32)
    # integers: scaled in float64, truncated toward zero, kept in their dtype
    got = hvd.allreduce(odd, op=hvd.Sum, prescale_factor=0.5)             # each 2k+1 -> k
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [n * (n - 1) // 2, -(n * (n - 1) // 2)])
    got = hvd.allreduce(odd, op=hvd.Sum, postscale_factor=0.5)            # n * n halved
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [math.trunc(n * n * 0.5), -math.trunc(n * n * 0.5)])
    # before the reduction: the Max of the negated values is minus their Min
    np.testing.assert_array_equal(hvd.allreduce(odd, op=hvd.Max, prescale_factor=-1.0),
                                  [-1, 2 * n - 1])
    # the factors are float32, as Horovod's TensorFlow op holds them, for float64 tensors too
    factor = float(np.float32(0.1))
    got = hvd.allreduce(np.array([r + 1.0]), op=hvd.Sum, prescale_factor=0.1)
    np.testing.assert_allclose(got, [math.fsum((k + 1) * factor for k in range(n))],
                               rtol=1e-14)
    assert abs(got[0] - 0.1 * n * (n + 1) / 2) > 1e-10
    got = hvd.allreduce(np.array([r + 1.0], np.float32), op=hvd.Sum, postscale_factor=0.1)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [np.float32(n * (n + 1) / 2) * np.float32(0.1)])
    # Average: the sum times postscale / size
    got = hvd.allreduce(np.array([r + 1.0]), postscale_factor=4.0)
    np.testing.assert_array_equal(got, [n * (n + 1) / 2 * (4.0 / n)])
    got = hvd.allreduce(np.array([r + 1.0]), op=hvd.Product, prescale_factor=2.0,
                        postscale_factor=0.5)
    np.testing.assert_array_equal(got, [math.prod(2.0 * (k + 1) for k in range(n)) * 0.5])


def test_fp16_compression_rounds_on_the_wire_and_returns_the_input_dtype(world):
    n, r = world.size, world.rank
    x = np.array([(r + 1) * (1 + 2.0 ** -12)])          # float16 holds r + 1, not the 2**-12
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [n * (n + 1) / 2])
    assert hvd.allreduce(x, op=hvd.Sum)[0] != got[0]        # uncompressed keeps the 2**-12
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.none),
                                  hvd.allreduce(x, op=hvd.Sum))
    # Average of float32: the float16 sum times float32(1/n), rounded to float16, as float32
    got = hvd.allreduce(x.astype(np.float32), compression=hvd.Compression.fp16)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [np.float16(np.float32(n * (n + 1) / 2) *
                                                   np.float32(1.0 / n)).astype(np.float32)])
    # integers travel as they are
    got = hvd.allreduce(np.array([r + 1], np.int64), op=hvd.Sum,
                        compression=hvd.Compression.fp16)
    assert got.dtype == np.int64 and got.tolist() == [n * (n + 1) // 2]
    wire, context = hvd.Compression.fp16.compress(np.ones(2))
    assert wire.dtype == np.float16
    assert hvd.Compression.fp16.decompress(wire, context).dtype == np.float64
    with pytest.raises(ValueError, match="is not a compressor"):
        hvd.allreduce(np.ones(2), compression="fp16")


def test_adasum_and_process_sets_other_than_the_global_one_are_refused_by_name(world):
    n = world.size
    with pytest.raises(NotImplementedError, match="op=Adasum is not supported") as err:
        hvd.allreduce(np.ones(2), op=hvd.Adasum)
    assert isinstance(err.value, ValueError) and isinstance(err.value, hvd.NotSupportedError)
    with pytest.raises(ValueError, match="op='mean' is not one of Horovod's reductions"):
        hvd.allreduce(np.ones(2), op="mean")
    for process_set in (None, hvd.global_process_set):
        np.testing.assert_array_equal(
            hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=process_set), [n, n])
    subset = hvd.ProcessSet([0])
    for call in (lambda: hvd.allreduce(np.ones(2), process_set=subset),
                 lambda: hvd.allgather(np.ones((1, 2)), process_set=subset),
                 lambda: hvd.broadcast(np.ones(2), 0, process_set=subset),
                 lambda: hvd.broadcast_object(1, 0, process_set=subset),
                 lambda: hvd.allgather_object(1, process_set=subset)):
        with pytest.raises(hvd.NotSupportedError,
                           match=r"process_set=ProcessSet\(\[0\]\) is not supported"):
            call()
    with pytest.raises(NotImplementedError, match="global_process_set only"):
        hvd.add_process_set(subset)


def test_a_root_that_is_no_rank_raises_on_every_rank(world):
    n = world.size
    with pytest.raises(ValueError, match=f"root_rank={n} is not a rank"):
        hvd.broadcast_object("x", root_rank=n)
    with pytest.raises(ValueError, match=f"the root {n} is not a rank"):
        hvd.broadcast(np.arange(3.0), n)
    root = np.int64(n - 1)                                    # a NumPy integer is a rank
    assert hvd.broadcast_object({"rank": world.rank}, root_rank=root) == {"rank": n - 1}


@pytest.mark.mpi(min_size=2)
@needs_validation
def test_ranks_passing_different_names_raise_on_every_rank_naming_each(world):
    mine = "loss" if world.rank == 0 else "acc"
    last = world.size - 1
    for call in (lambda: hvd.allreduce(np.ones(3), name=mine),          # inside the probe
                 lambda: hvd.allreduce(np.ones(30), op=hvd.Max, name=mine),   # the long path
                 lambda: hvd.allreduce(np.ones(3), op=hvd.Product, name=mine),
                 lambda: hvd.allgather(np.ones((1, 2)), name=mine),
                 lambda: hvd.broadcast(np.ones(2), 0, name=mine)):
        with pytest.raises(ValueError) as err:
            call()
        text = str(err.value)
        assert "rank 0 calls" in text and f"rank {last} calls" in text, text
        assert "name='loss'" in text and "name='acc'" in text, text
    for call in (lambda: hvd.broadcast_object({"a": 1}, 0, name=mine),
                 lambda: hvd.allgather_object(1, name=mine)):
        with pytest.raises(ValueError, match="ranks pass different names: rank 0 has "
                                             "name='loss'; rank 1 has name='acc'"):
            call()
    # a name on one rank only differs too (Horovod would wait for it forever)
    with pytest.raises(ValueError, match="name='loss'"):
        hvd.allreduce(np.ones(3), name="loss" if world.rank == 0 else None)
    # the ranks are still in step: the same name everywhere works
    np.testing.assert_array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum, name="loss"),
                                  np.full(3, world.size))
    assert hvd.allgather_object(world.rank, name="ranks") == list(range(world.size))


@pytest.mark.mpi(min_size=2)
@needs_validation
def test_ranks_passing_different_ops_factors_or_compression_raise_on_every_rank(world):
    first = world.rank == 0
    with pytest.raises(ValueError, match="op=Average.*op=Sum"):
        hvd.allreduce(np.ones(3), op=hvd.Average if first else hvd.Sum)
    with pytest.raises(ValueError, match="prescale_factor=2.0"):
        hvd.allreduce(np.ones(3), op=hvd.Sum, prescale_factor=2.0 if first else 1.0)
    with pytest.raises(ValueError, match="postscale_factor=0.5"):
        hvd.allreduce(np.ones(3), op=hvd.Sum, postscale_factor=0.5 if first else 1.0)
    with pytest.raises(ValueError, match="compression=Compression.fp16"):
        hvd.allreduce(np.ones(3), op=hvd.Sum, compression=hvd.Compression.fp16 if first else
                      hvd.Compression.none)
    # a call refused on one rank while the others reduce: every rank raises, naming it
    with pytest.raises(ValueError, match="op=Adasum is not supported"):
        hvd.allreduce(np.ones(3), op=hvd.Adasum if first else hvd.Sum)
    np.testing.assert_array_equal(hvd.allreduce(np.ones(3), op=hvd.Sum), np.full(3, world.size))


class Variable:
    def __init__(self, value):
        self.value = np.asarray(value)

    def assign(self, value):
        self.value = np.asarray(value)


@pytest.mark.mpi(min_size=2)
def test_ranks_naming_different_broadcast_roots_raise_on_every_rank_naming_each(world):
    r, last = world.rank, world.size - 1
    with pytest.raises(ValueError, match="ranks pass different root_ranks: rank 0 has "
                                         "root_rank=0; rank 1 has root_rank=1"):
        hvd.broadcast_object({"rank": r}, root_rank=r)
    if settings.get("MPISTRAT_VALIDATE"):   # (tensors: agreed in the validation probe)
        with pytest.raises(ValueError, match="rank 0 calls broadcast root=0.*rank 1 calls "
                                             "broadcast root=1"):
            hvd.broadcast(np.arange(3.0), root_rank=r)
        variable = Variable(np.full(2, float(r)))
        with pytest.raises(ValueError, match="rank 0 calls broadcast root=0.*rank 1 calls "
                                             "broadcast root=1"):
            hvd.broadcast_variables([variable], root_rank=r)
        np.testing.assert_array_equal(variable.value, np.full(2, float(r)))   # untouched
    # still in step: one root everywhere
    assert hvd.broadcast_object({"rank": r}, root_rank=last) == {"rank": last}
    np.testing.assert_array_equal(hvd.broadcast(np.arange(3.0) + r, last), np.arange(3.0) + last)
