"""``all_reduce(..., out=)`` at 1-4 ranks: results written into the caller's buffers (in
place with ``out=value``) are those of the ordinary call; a bad ``out`` on any rank raises on
every rank, naming the buffer, before anything travels."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine
from mpistrat.errors import InvalidArgumentError

pytestmark = pytest.mark.numpy_only("out= takes host NumPy buffers only")


def tensors(rank):
    """Small tensors (fused), one of 64 KiB and more (alone), and dtypes that travel wide;
    integer-valued floats, so any order of addition gives the same bits."""
    rng = np.random.default_rng(40 + rank)
    shapes = [(3,), (7, 5), (64,), (129, 130), (5,), (300, 200), (1,)]
    values = [rng.integers(-500, 500, s).astype(np.float32) for s in shapes]
    values += [rng.integers(-9, 9, (40, 3)).astype(np.int32), np.full(6, 0.5 + rank, np.float16),
               rng.integers(-9, 9, (70_000,)).astype(np.float64)]
    return values


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
def test_in_place_and_into_other_buffers_give_the_ordinary_results(world, op):
    engine = CollectiveEngine(world.comm)
    mine = tensors(world.rank)
    want = engine.all_reduce(mine, op)
    others = [np.full_like(a, -1) for a in mine]
    got = engine.all_reduce(mine, op, out=others)
    assert got is others
    for a, w, o, fresh in zip(mine, want, others, tensors(world.rank)):
        assert o.dtype == w.dtype and o.tobytes() == w.tobytes()
        assert a.tobytes() == fresh.tobytes()          # inputs untouched
    addresses = [a.ctypes.data for a in mine]
    same = engine.all_reduce(mine, op, out=mine)       # in place
    assert same is mine and [a.ctypes.data for a in mine] == addresses
    for a, w in zip(mine, want):
        assert a.tobytes() == w.tobytes()
    one = tensors(world.rank)[5]
    assert engine.all_reduce(one, op, out=one) is one and one.tobytes() == want[5].tobytes()


@pytest.mark.mpi(min_size=1)
def test_deterministic_sums_into_out_have_the_reproducible_bits(world):
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    x = np.random.default_rng(world.rank).standard_normal(5000).astype(np.float32) * 1e3
    want = engine.all_reduce(x, "SUM")
    engine.all_reduce([x], "SUM", out=[x])
    assert x.tobytes() == want.tobytes()


@pytest.mark.mpi(min_size=2)
def test_a_bad_out_on_one_rank_raises_on_every_rank_naming_it(world):
    engine = CollectiveEngine(world.comm)
    x = np.ones(10)
    bad = np.empty(9) if world.rank == world.size - 1 else np.empty(10)
    with pytest.raises(InvalidArgumentError, match=r"out has shape \(9,\)"):
        engine.all_reduce(x, "SUM", out=bad)
    read_only = np.ones(10)
    read_only.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="out is read-only"):
        engine.all_reduce(x, "SUM", out=read_only)         # the same on every rank
    pair = [np.ones(4), np.ones(4)]
    with pytest.raises(InvalidArgumentError, match=r"out\[0\] and out\[1\] overlap"):
        engine.all_reduce(pair, "SUM", out=[pair[0], pair[0]])
    assert engine.all_reduce(x, "SUM", out=x) is x and (x == world.size).all()  # still usable


@pytest.mark.mpi(min_size=1)
def test_out_refuses_nests_and_other_array_kinds_on_every_rank(world):
    engine = CollectiveEngine(world.comm)
    with pytest.raises(InvalidArgumentError, match="not a dict"):
        engine.all_reduce({"w": np.ones(2)}, "SUM", out={"w": np.ones(2)})
    with pytest.raises(InvalidArgumentError, match="list or tuple of 2"):
        engine.all_reduce([np.ones(2), np.ones(2)], "SUM", out=[np.ones(2)])


@pytest.mark.mpi(min_size=1)
def test_a_large_tensor_into_out_takes_the_ring_and_in_place_mpi_alike(world):
    """4 MiB: the ring out of place and MPI's own in place (one node) give the same sums."""
    x = np.random.default_rng(world.rank).integers(-99, 99, 1 << 20).astype(np.float32)
    engine = CollectiveEngine(world.comm)
    want = engine.all_reduce(x, "SUM")
    apart = np.empty_like(x)
    assert engine.all_reduce(x, "SUM", out=apart) is apart
    assert apart.tobytes() == want.tobytes()
    engine.all_reduce([x], "SUM", out=[x])
    assert x.tobytes() == want.tobytes()


@pytest.mark.mpi(min_size=2)
def test_ranks_that_differ_on_in_place_raise_together_instead_of_hanging(world):
    """In place or not decides the algorithm (MPI's own or the ring for 4 MiB on one node),
    so ranks that differ on it would wait in different collectives: every rank raises."""
    x = np.ones(1 << 20, np.float32)
    out = x if world.rank == 0 else np.empty_like(x)
    with pytest.raises(InvalidArgumentError, match="different collectives.*in place"):
        CollectiveEngine(world.comm).all_reduce(x, "SUM", out=out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("deterministic", [False, True])
def test_out_on_one_rank_only_raises_together(world, deterministic):
    """One rank passes ``out`` (a bad one where the reduction is reproducible), the others
    call the ordinary all-reduce: every rank raises, none waits."""
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=deterministic))
    x = np.ones(1000, np.float32)
    if world.rank == 0:
        out = np.empty(999, np.float32) if deterministic else np.empty_like(x)
        call = lambda: engine.all_reduce(x, "SUM", out=out)   # noqa: E731
    else:
        call = lambda: engine.all_reduce(x, "SUM")            # noqa: E731
    with pytest.raises(InvalidArgumentError, match="different collectives"):
        call()
    assert (engine.all_reduce(x, "SUM") == world.size).all()   # the engine still works
