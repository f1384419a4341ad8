"""Reproducible sums at 1-4 ranks: the same bits whatever the rank count, split, algorithm or
array kind (``arrays``, MPISTRAT_TEST_ARRAYS: the digest written for scripts/test.sh must be
the same for every kind)."""

import hashlib
import os

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine
from mpistrat.collectives.reproducible import from_fixed, grid_for, max_exponent, to_fixed
from mpistrat.errors import InvalidArgumentError

SEED = 20261201
GLOBAL_ROWS = 29  # splits unevenly over 2, 3 and 4 ranks


def global_batch():
    """Per-example gradients with a wide dynamic range: float sums depend on the order."""
    rng = np.random.default_rng(SEED)
    scale = np.exp(rng.uniform(-12, 12, (GLOBAL_ROWS, 7, 5)))
    return {"w": (rng.standard_normal((GLOBAL_ROWS, 7, 5)) * scale).astype(np.float32),
            "b": rng.standard_normal((GLOBAL_ROWS, 3)).astype(np.float64) * 1e6,
            "n": rng.integers(-50, 50, (GLOBAL_ROWS, 2)).astype(np.int64)}


def my_rows(batch, rank, size):
    """TensorFlow's rebatch split: ceil(B/N) rows per replica, the last ones short or empty."""
    per = -(-GLOBAL_ROWS // size)
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def reference_sum(rows):
    """The fixed-point sum of all rows at once, computed here on one process."""
    e = max_exponent(rows)
    wire, bits = grid_for(rows.dtype, e, rows.shape[0])
    return from_fixed(to_fixed(rows, e, bits, wire, axis=0), e, bits, rows.dtype)


def deterministic_strategy():
    return ms.MultiWorkerMirroredStrategy(
        communication_options=ms.CommunicationOptions(deterministic=True))


@pytest.mark.mpi(min_size=1)
def test_reduce_sum_along_batch_has_the_same_bits_at_any_rank_count(world, arrays):
    strategy = deterministic_strategy()
    batch = global_batch()
    mine = my_rows(batch, world.rank, world.size)
    kept = strategy.reduce("SUM", arrays.tree(mine), axis=0)
    out = {k: arrays.numpy(v) for k, v in kept.items()}
    for key in ("w", "b"):
        want = reference_sum(batch[key])
        assert out[key].dtype == batch[key].dtype
        assert out[key].tobytes() == want.tobytes(), key
        np.testing.assert_allclose(out[key], batch[key].astype(np.float64).sum(0), rtol=1e-5)
    np.testing.assert_array_equal(out["n"], batch["n"].sum(0))
    digest = hashlib.sha256(b"".join(out[k].tobytes() for k in ("b", "n", "w"))).hexdigest()
    where = os.environ.get("MPISTRAT_REPRO_DIR")  # scripts/test.sh compares runs at 1-4 ranks
    if where and world.rank == 0:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"seed{SEED}.np{world.size}.sha256"), "w") as handle:
            handle.write(digest + "\n")
    if world.size > 1:  # the ordinary sum of the same rows does depend on the split
        plain = ms.MultiWorkerMirroredStrategy().reduce("SUM", {"w": mine["w"]}, axis=0)["w"]
        ordered = np.sum(batch["w"], axis=0)
        assert plain.tobytes() != out["w"].tobytes() or ordered.tobytes() != out["w"].tobytes()
    arrays.assert_kind(kept)


@pytest.mark.mpi(min_size=1)
def test_mean_along_batch_divides_the_exact_sum_by_all_rows(world, arrays):
    strategy = deterministic_strategy()
    batch = global_batch()
    out = strategy.reduce("MEAN", arrays.tree(my_rows(batch, world.rank, world.size)), axis=0)
    assert arrays.numpy(out["w"]).tobytes() == \
        (reference_sum(batch["w"]) / GLOBAL_ROWS).tobytes()
    arrays.assert_kind(out)


def rank_values(rank):
    rng = np.random.default_rng(SEED + rank)
    return (rng.standard_normal(300_000) * np.exp(rng.uniform(-20, 20, 300_000))).astype(np.float32)


@pytest.mark.mpi(min_size=1)
def test_element_wise_sum_is_the_same_whatever_the_algorithm_and_fusion(world, arrays):
    mine = rank_values(world.rank)                              # 1.2 MB: the ring algorithm
    every = np.stack([rank_values(r) for r in range(world.size)])
    want = reference_sum(every)
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    whole = engine.all_reduce(arrays.asarray(mine), "SUM")
    arrays.assert_kind(whole)
    assert arrays.numpy(whole).tobytes() == want.tobytes()
    pieces = [arrays.asarray(p) for p in np.array_split(mine, 300)]  # 4 KB: fused, MPI's own
    fused = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True,
                                                                 bytes_per_pack=64 << 10))
    out = fused.all_reduce(pieces, "SUM")
    # each piece has its own scale, so compare each piece with its own reference
    every_pieces = [np.array_split(row, 300) for row in every]
    for k, piece in enumerate(out):
        ref = reference_sum(np.stack([p[k] for p in every_pieces]))
        arrays.assert_kind(piece)
        assert arrays.numpy(piece).tobytes() == ref.tobytes()
    mean = engine.all_reduce([arrays.asarray(mine), arrays.asarray(world.rank, np.float64)],
                             "MEAN")
    arrays.assert_kind(mean)
    assert arrays.numpy(mean[0]).tobytes() == (want / np.float32(world.size)).tobytes()
    assert arrays.numpy(mean[1]) == sum(range(world.size)) / world.size


@pytest.mark.mpi(min_size=1)
def test_per_call_option_and_environment_switch_it_on(world, monkeypatch):
    plain = CollectiveEngine(world.comm)
    assert not plain.is_deterministic()
    assert plain.is_deterministic(ms.CommunicationOptions(deterministic=True))
    monkeypatch.setenv("MPISTRAT_DETERMINISTIC", "1")
    engine = CollectiveEngine(world.comm)
    assert engine.is_deterministic()
    every = np.stack([rank_values(r)[:1000] for r in range(world.size)])
    out = engine.all_reduce(rank_values(world.rank)[:1000], "SUM")
    assert out.tobytes() == reference_sum(every).tobytes()
    ctx_out = ms.MultiWorkerMirroredStrategy().run(
        lambda x: ms.get_replica_context().all_reduce("SUM", x),
        args=(rank_values(world.rank)[:1000],))
    assert ctx_out.tobytes() == out.tobytes()


@pytest.mark.mpi(min_size=1)
def test_nan_and_zero_tensors(world, arrays):
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    poisoned = np.ones(4, np.float32)
    if world.rank == world.size - 1:
        poisoned[2] = np.nan
    out = engine.all_reduce(arrays.tree([poisoned, np.zeros(3), np.ones(2, np.int32)]), "SUM")
    arrays.assert_kind(out)
    host = [arrays.numpy(o) for o in out]
    assert np.isnan(host[0][2]) and host[0][0] == world.size
    assert host[1].dtype == np.float64 and not host[1].any()
    np.testing.assert_array_equal(host[2], [world.size] * 2)


@pytest.mark.mpi(min_size=1)
def test_a_nan_past_the_first_block_still_poisons_its_column(world):
    """The exponent is found block by block (64 Ki elements): a NaN in a later block must
    still make the tensor non-finite, so its column sums to NaN (on the integer grid of 16
    rows along the axis a lost NaN would be cast to a finite number)."""
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    rows = np.ones((16, 10_000), np.float32)
    if world.rank == world.size - 1:
        rows[10, 7_000] = np.nan            # flat index 107,000: the second block
    assert max_exponent(rows) == (1 << 30 if world.rank == world.size - 1 else 1)
    (total,), _ = engine.exact_sum([rows], axis=0)
    assert np.isnan(total[7_000]) and np.isnan(total).sum() == 1
    assert total[0] == 16 * world.size


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_determinism_raise_together(world):
    options = ms.CommunicationOptions(deterministic=world.rank == 0)
    engine = CollectiveEngine(world.comm)
    with pytest.raises(InvalidArgumentError, match="different collectives"):
        engine.all_reduce(np.ones(3), "SUM", options)


@pytest.mark.mpi(min_size=1)
def test_timed_deterministic_sum(world, arrays):
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True,
                                                                  timeout_seconds=30.0))
    every = np.stack([rank_values(r)[:500] for r in range(world.size)])
    out = engine.all_reduce(arrays.asarray(rank_values(world.rank)[:500]), "SUM")
    arrays.assert_kind(out)
    assert arrays.numpy(out).tobytes() == reference_sum(every).tobytes()


@pytest.mark.mpi(min_size=1)
def test_guessed_exponents_never_change_a_bit_when_ranks_change_scale_apart(world):
    """One engine reduces a tensor whose scale changes between calls on some ranks only, so
    each rank's guess is right or wrong on its own: every result has the bits of the
    reference (and of an engine without guesses); NaN and zeros between the calls too."""
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    base = np.stack([rank_values(r) for r in range(world.size)])
    for call, scale in enumerate([1.0, 1.0, 8.0, 8.0, 1e-4, 0.0, 1.0, float("nan"), 1.0]):
        factors = np.ones(world.size)
        factors[call % world.size] = scale        # one rank changes scale at each call
        every = base * factors[:, None].astype(np.float32)
        got = engine.all_reduce(every[world.rank], "SUM")
        fresh = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
        plain = fresh.all_reduce(every[world.rank], "SUM")
        assert got.tobytes() == plain.tobytes(), call
        if np.isfinite(every).all() and every.any():
            assert got.tobytes() == reference_sum(every).tobytes(), call


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_a_guessed_exponent_saves_a_pass_and_never_changes_a_bit(world, dtype):
    """Beyond two ranks (a grid is needed): a sequence of calls whose magnitudes change (the
    guess right, then wrong, then zero, NaN, then right again); with guesses every result
    has the bits of the call without, and a pass is saved wherever a guess was kept."""
    from mpistrat.collectives import reproducible
    from mpistrat.collectives.reproducible import exact_sum
    rng = np.random.default_rng(3)
    base = rng.standard_normal((3, 5000)).astype(dtype)
    if np.dtype(dtype).kind == "c":
        base = base + 1j * rng.standard_normal((3, 5000)).astype(dtype)
    with_nan = base.copy()
    with_nan[1, 7] = np.nan
    sequence = [base, base * 1.01, base * 3.0, base * 1e-3, np.zeros_like(base), with_nan,
                base, base]
    comm = world.comm.Dup()

    def sum_across(wires):
        return [comm.allreduce(w) for w in wires]
    guesses, passes = {}, []
    original = reproducible.exponent_and_grid

    def counted(*args):
        passes.append(args[1])
        return original(*args)
    reproducible.exponent_and_grid = counted
    try:
        for values in sequence:
            for mean in (False, True):
                plain = exact_sum(comm, [values], None, sum_across, mean=mean)[0][0]
                fast = exact_sum(comm, [values], None, sum_across, mean=mean,
                                 guesses=guesses)[0][0]
                assert fast.dtype == plain.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(fast.view(np.uint8), plain.view(np.uint8))
    finally:
        reproducible.exponent_and_grid = original
        comm.Free()
    # one pass wherever a guess was kept: not the first call, nor after an all-zero or
    # non-finite tensor (no grid to guess), up to the next finite one (16 calls - 5)
    assert len(passes) == 2 * len(sequence) - 5


@pytest.mark.mpi(min_size=1)
def test_at_two_ranks_or_fewer_the_floats_are_added_once(world):
    """Element-wise at 1-2 ranks each element has at most two summands: the result is their
    one float addition (the input itself at one rank), the sign of a zero included, on
    either rank, with no grid; beyond, the grid's sum."""
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    every = np.stack([rank_values(r) for r in range(world.size)])
    every[:, :2] = -0.0
    got = engine.all_reduce(every[world.rank], "SUM")
    if world.size <= 2:
        want = every[0] if world.size == 1 else every[0] + every[1]
        assert got.tobytes() == want.tobytes()
        assert np.signbit(got[:2]).all()
        assert not np.shares_memory(got, every)      # a new array, even at one rank
    else:
        assert got.tobytes() == reference_sum(every).tobytes()


@pytest.mark.mpi(min_size=1)
def test_two_rows_along_an_axis_add_once_whatever_ranks_hold_them(world):
    """Two rows in all, held by the first and the last rank (ranks between hold none and
    send -0.0): the one float addition of the rows, zero signs included, at any width."""
    rng = np.random.default_rng(SEED)
    rows = (rng.standard_normal((2, 500)) * np.exp(rng.uniform(-30, 30, (2, 500))))
    rows[:, :3] = [[-0.0, -0.0, 0.0], [-0.0, 0.0, -0.0]]
    if world.size == 1:
        mine = rows
    else:
        mine = rows[:1] if world.rank == 0 else rows[1:] if world.rank == world.size - 1 \
            else rows[:0]
    engine = CollectiveEngine(world.comm, ms.CommunicationOptions(deterministic=True))
    (total,), counts = engine.exact_sum([mine], axis=0)
    assert counts == [2]
    assert total.tobytes() == (rows[0] + rows[1]).tobytes()
    assert np.signbit(total[:3]).tolist() == [True, False, False]
