"""Pure parts of the reproducible sums: exponents, grids, fixed-point conversion."""

import math

import numpy as np
import pytest

from mpistrat.collectives.reproducible import (NONFINITE, ZERO, from_fixed, grid_for, max_exponent,
                                               to_fixed)


def exact_fixed_sum(rows, count=None):
    """The fixed-point sum of all rows along axis 0, as the collective computes it."""
    e = max_exponent(rows)
    wire, bits = grid_for(rows.dtype, e, count or rows.shape[0])
    return from_fixed(to_fixed(rows, e, bits, wire, axis=0), e, bits, rows.dtype)


def test_max_exponent_bounds_the_largest_magnitude():
    assert max_exponent(np.array([0.75, -3.0])) == 2          # 3 < 2**2
    assert max_exponent(np.array([4.0])) == 3                  # 4 < 2**3
    assert max_exponent(np.array([1e-30], np.float32)) == int(np.frexp(1e-30)[1])
    assert max_exponent(np.zeros(3)) == ZERO
    assert max_exponent(np.zeros(0)) == ZERO
    assert max_exponent(np.array([1.0, np.nan])) == NONFINITE
    assert max_exponent(np.array([np.inf])) == NONFINITE
    assert max_exponent(np.array([3 + 4j])) == 3              # parts, not modulus


@pytest.mark.parametrize("dtype,count,wire", [
    (np.float32, 3, np.float32), (np.float32, 7, np.float32), (np.float32, 8, np.int32),
    (np.float32, 127, np.int32), (np.float32, 128, np.int64), (np.float16, 10**5, np.int32),
    (np.float64, 4, np.float64), (np.float64, 8, np.int64)])
def test_grid_never_overflows_and_keeps_the_significand(dtype, count, wire):
    got, bits = grid_for(dtype, 5, count)
    assert got == np.dtype(wire)
    significand = {np.float16: 11, np.float32: 24, np.float64: 53}[dtype]
    if got.kind == "f":   # sums of grid values stay exact in the float
        assert count < 2 ** (significand - bits) and bits >= significand - 3
    else:
        assert count * (1 << bits) <= np.iinfo(got).max  # M summands of |q| <= 2**F fit
        assert bits >= min(significand, 63 - count.bit_length())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_wire_sums_exactly_in_any_order(dtype):
    rng = np.random.default_rng(11)
    rows = (rng.standard_normal((4, 1000)) * np.exp(rng.uniform(-30, 30, (4, 1000)))).astype(dtype)
    e = max_exponent(rows)
    wire, bits = grid_for(dtype, e, 4)
    assert wire == np.dtype(dtype)
    grid = [to_fixed(r, e, bits, wire) for r in rows]
    exact = np.array([math.fsum(col) for col in np.array(grid, np.float64).T])
    orders = [grid[0] + grid[1] + grid[2] + grid[3], (grid[3] + grid[1]) + (grid[2] + grid[0]),
              to_fixed(rows[::-1], e, bits, wire, axis=0)]
    for total in orders:
        out = from_fixed(total, e, bits, dtype)
        assert out.tobytes() == orders[0].tobytes()
        np.testing.assert_array_equal(out.astype(np.float64), exact)  # no rounding at all


def test_sum_is_independent_of_order_and_split():
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((96, 33)) * np.exp(rng.uniform(-8, 8, (96, 33)))).astype(np.float32)
    reference = exact_fixed_sum(rows)
    shuffled = exact_fixed_sum(rows[rng.permutation(96)])
    assert reference.tobytes() == shuffled.tobytes()
    # split into 4 uneven parts, summed as integers part by part: same bits
    e = max_exponent(rows)
    wire, bits = grid_for(rows.dtype, e, 96)
    parts = [to_fixed(p, e, bits, wire, axis=0) for p in np.split(rows, [5, 40, 41])]
    assert from_fixed(sum(parts), e, bits, rows.dtype).tobytes() == reference.tobytes()
    # and the ordinary float sum depends on the order (so this test can see a difference)
    plain = [np.sum(rows[p], axis=0) for p in (np.arange(96), rng.permutation(96), rng.permutation(96))]
    assert any(a.tobytes() != plain[0].tobytes() for a in plain[1:])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_accuracy_is_within_the_documented_bound(dtype):
    rng = np.random.default_rng(3)
    rows = rng.uniform(-1000, 1000, (50, 20)).astype(dtype)
    got = exact_fixed_sum(rows).astype(np.float64)
    exact = np.array([math.fsum(column) for column in rows.astype(np.float64).T])  # exact
    e = max_exponent(rows)
    _, bits = grid_for(dtype, e, 50)
    bound = 50 * 2.0 ** (e - bits) + np.abs(exact) * np.finfo(dtype).eps
    assert np.all(np.abs(got - exact) <= bound)


def test_values_on_the_grid_sum_exactly_and_complex_and_zero_work():
    rows = np.array([[0.5, 1.25], [0.25, -1.0]], np.float32)
    np.testing.assert_array_equal(exact_fixed_sum(rows), [0.75, 0.25])
    c = np.array([[1 + 2j, 0.5j], [3 - 1j, 2 + 0j]], np.complex64)
    np.testing.assert_allclose(exact_fixed_sum(c), c.sum(axis=0), rtol=1e-6)
    z = exact_fixed_sum(np.zeros((3, 2), np.float64))
    assert z.dtype == np.float64 and not z.any()


def test_tiny_and_huge_magnitudes_scale_without_overflow():
    tiny = np.array([[1e-40, 2e-40], [3e-40, 0.0]], np.float32)   # subnormal float32
    np.testing.assert_allclose(exact_fixed_sum(tiny), [4e-40, 2e-40], rtol=1e-5)
    huge = np.array([[1e300], [-1e300], [1.0]], np.float64)
    assert exact_fixed_sum(huge)[0] == 0.0       # 1.0 is below the grid of 1e300: documented
    big = np.array([[3e38], [-1e38]], np.float32)
    np.testing.assert_allclose(exact_fixed_sum(big), [2e38], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
def test_two_summands_are_added_once_whatever_the_split_or_order(dtype):
    """Two rows need no grid: each rank sends its rows added once (or -0.0 for none), and
    any order of adding those gives the one float addition of the two rows, the sign of a
    zero included; the narrow floats add in float32 and round once."""
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((2, 999)) * np.exp(rng.uniform(-9, 9, (2, 999)))).astype(dtype)
    rows[:, :4] = [[-0.0, -0.0, 0.0, 1.5], [-0.0, 0.0, -0.0, -1.5]]
    if np.dtype(dtype).kind == "c":
        rows = rows + 1j * rows[::-1]
    wide = np.float32 if dtype == np.float16 else dtype
    want = (rows[0].astype(wide) + rows[1].astype(wide)).astype(dtype)
    wire, bits = grid_for(dtype, max_exponent(rows), 2)
    assert bits is None and wire == np.dtype(np.float32 if dtype != np.float64 else np.float64)
    assert exact_fixed_sum(rows).tobytes() == want.tobytes()
    assert exact_fixed_sum(rows[::-1]).tobytes() == want.tobytes()
    for split in ([2], [1], [0]):                      # rows per rank: (0, 2), (1, 1), (2, 0)
        parts = [to_fixed(p, 0, None, wire, axis=0) for p in np.split(rows, split)]
        for total in (parts[0] + parts[1], parts[1] + parts[0],
                      (parts[1] + np.float32(-0.0)) + parts[0]):   # a third, empty, rank
            assert from_fixed(total, 0, None, dtype).tobytes() == want.tobytes(), split
    assert np.signbit(want.real[:3]).tolist() == [True, False, False]
    mean = from_fixed(parts[0] + parts[1], 0, None, dtype, divisor=2)
    total = rows[0].astype(wide) + rows[1].astype(wide)
    real = total.view(total.real.dtype) if total.dtype.kind == "c" else total
    assert mean.tobytes() == (real / 2).view(total.dtype).astype(dtype).tobytes()  # by parts
    with pytest.raises(ValueError, match="3 rows"):
        to_fixed(np.ones((3, 2), dtype), 0, None, wire, axis=0)


def test_at_one_rank_the_sum_is_the_tensor_itself_and_no_exponent_is_found():
    """One summand: no exponent pass, no Allgather, and every bit of the input kept (a grid
    would cut the last bits)."""
    from mpi4py import MPI
    from mpistrat.collectives import reproducible
    from mpistrat.collectives.reproducible import exact_sum
    x = np.random.default_rng(2).standard_normal(70_000).astype(np.float32) * 3
    x[5] = -0.0
    found = []
    original = reproducible.max_exponent
    reproducible.max_exponent = lambda a: found.append(a) or original(a)
    try:
        out = exact_sum(MPI.COMM_SELF, [x], None, lambda w: [np.array(v) for v in w])[0][0]
        mean = exact_sum(MPI.COMM_SELF, [x.astype(np.float16)], None,
                         lambda w: [np.array(v) for v in w], mean=True)[0][0]
    finally:
        reproducible.max_exponent = original
    assert found == []
    assert out.tobytes() == x.tobytes()
    assert mean.dtype == np.float16 and mean.tobytes() == x.astype(np.float16).tobytes()


def test_the_one_pass_grid_is_to_fixed_where_the_guess_is_right():
    from mpistrat.collectives.reproducible import exponent_and_grid
    x = np.random.default_rng(1).standard_normal(300_001).astype(np.float32) * 7
    e = max_exponent(x)
    wire, bits = grid_for(x.dtype, e, 3)
    found, grid = exponent_and_grid(x, e, bits, wire)
    assert found == e
    np.testing.assert_array_equal(grid, to_fixed(x, e, bits, wire))
    wrong, _ = exponent_and_grid(x * 4, e, bits, wire)
    assert wrong == e + 2                                # the real exponent, whatever the guess
