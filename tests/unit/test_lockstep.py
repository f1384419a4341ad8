"""The window math of distributed datasets' lockstep (``distribute/lockstep.py``), and its
windows on one rank (where counting the flags over the ranks is the flags themselves)."""

import pytest

from mpistrat.distribute import lockstep
from mpistrat.distribute.lockstep import LEVELS, Lockstep, agreed_size, window_size

END = object()


def test_windows_double_up_to_the_largest_level():
    sizes = [1]
    for _ in range(6):
        sizes.append(window_size(sizes[-1], 1e-4, 1 << 10))
    assert sizes == [1, 2, 4, 8, 16, 16, 16]


@pytest.mark.parametrize("pace, largest, expected", [
    (lockstep.WINDOW_SECONDS / 4, 0, 4),               # slow steps: 4 fit the time
    (lockstep.WINDOW_SECONDS / 3, 0, 2),
    (lockstep.WINDOW_SECONDS * 2, 0, 1),               # one step over budget: still 1
    (0.0, lockstep.WINDOW_BYTES // 8, 8),              # large batches: 8 fit the bytes
    (0.0, lockstep.WINDOW_BYTES * 3, 1),
])
def test_a_window_fits_the_time_and_bytes_budgets(pace, largest, expected):
    assert window_size(16, pace, largest) == expected


def test_the_ranks_take_the_smallest_proposal():
    assert agreed_size([0, 0, 0, 3, 1]) == 8
    assert agreed_size([1, 0, 0, 0, 5]) == 1
    assert agreed_size([0] * len(LEVELS)) == 1


def stream(values, fail_at=None):
    """A rank's pull(): its values, a failure at ``fail_at``, then the end."""
    items = iter(values)
    pulled = []

    def pull():
        k = len(pulled)
        pulled.append(k)
        if k == fail_at:
            return END, RuntimeError(f"step {k}")
        return next(items, END), None
    return pull, pulled


def test_steps_come_in_order_with_their_counts_and_windows_grow():
    pull, pulled = stream(range(40))
    windows = []

    def count(flags):
        windows.append(len(flags))
        return [float(f) for f in flags]

    steps = Lockstep(pull, lambda e, f: [e is not END, f is not None], count, END)
    served = [steps.next() for _ in range(41)]
    assert [e for e, _, _ in served[:40]] == list(range(40))
    assert all(c == [1.0, 0.0] for _, _, c in served[:40])
    assert served[40][0] is END and served[40][2] == [0.0, 0.0]
    # flags of each step plus one vote per level: windows of 1, 2, 4, 8, 16, 16 steps
    assert windows == [2 * n + len(LEVELS) for n in (1, 2, 4, 8, 16, 16)]
    assert len(pulled) == 41      # nothing pulled after the end


def test_nothing_is_read_past_a_failure_and_its_step_is_flagged():
    pull, pulled = stream(range(40), fail_at=5)
    steps = Lockstep(pull, lambda e, f: [f is not None], lambda f: f, END)
    served = [steps.next() for _ in range(7)]     # windows of 1, 2 and 4 steps
    assert [c[:1] for _, _, c in served] == [[False]] * 5 + [[True], [False]]
    assert str(served[5][1]) == "step 5"
    assert len(pulled) == 6


def test_one_rank_pulls_a_step_at_a_time_and_a_clear_starts_over():
    pull, pulled = stream(range(10))
    steps = Lockstep(pull, lambda e, f: [e is not END], lambda f: f, END, grow=False)
    assert [steps.next()[0] for _ in range(3)] == [0, 1, 2] and len(pulled) == 3
    grown = Lockstep(pull, lambda e, f: [e is not END], lambda f: [float(x) for x in f], END)
    grown.next(), grown.next()               # windows of 1, then 2: one step left over
    grown.clear()
    assert grown._ahead == type(grown._ahead)() and grown._size == 1


def test_a_window_counts_the_bytes_of_strings_and_never_fails_on_a_leaf():
    import numpy as np
    strings = np.empty(4, dtype=object)
    strings[:] = [b"x" * 1000] * 4
    assert lockstep._nbytes({"s": strings, "n": np.zeros(10)}) == strings.nbytes + 4000 + 80

    class Odd:
        nbytes = float("nan")
    assert lockstep._nbytes([Odd()]) == 0
