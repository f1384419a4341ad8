"""Distributed datasets' lockstep, agreed a window of steps at a time.

Every rank reads its next steps ahead (a *window*), then one collective counts, for each step
of the window, how many ranks have data, need a layout or failed to read; the steps are then
served from the window with no collective. So the ranks stop on the same step, raise a read
failure on the same step and yield 0-row batches on the same steps as when they meet at every
step; only the read-ahead differs. A window starts at one step and at most doubles each time,
up to ``LEVELS[-1]`` steps, while it holds at most ``WINDOW_SECONDS`` of reading (at the last
window's pace) and ``WINDOW_BYTES`` of its largest element, on every rank: the ranks agree on
the next window's size in the same collective. Ranks that meet every 16 steps instead of every
step lose less time to a rank that the machine descheduled::

    >>> window_size(4, seconds_per_step=0.001, largest=1 << 20)
    8
    >>> window_size(4, seconds_per_step=0.2, largest=1 << 20)   # 2 x 0.2 s > WINDOW_SECONDS
    1
    >>> agreed_size([0.0, 0.0, 2.0, 1.0, 0.0])                  # the smallest proposal
    4
"""

import time
from collections import deque
from typing import Any, Callable, List, Sequence, Tuple

from mpistrat import nest

__all__ = ["Lockstep", "window_size", "agreed_size", "LEVELS", "WINDOW_SECONDS",
           "WINDOW_BYTES"]

LEVELS = (1, 2, 4, 8, 16)   # the window sizes a rank may propose
WINDOW_SECONDS = 0.25       # reading one window takes at most this long (at the last pace)
WINDOW_BYTES = 64 << 20     # one window holds at most this many bytes of elements


def window_size(current: int, seconds_per_step: float, largest: int) -> int:
    """The largest of ``LEVELS`` at most twice ``current`` whose steps, read at
    ``seconds_per_step`` and each at most ``largest`` bytes, stay within both budgets
    (at least 1)."""
    fits = [level for level in LEVELS if level <= 2 * current and
            level * seconds_per_step <= WINDOW_SECONDS and level * largest <= WINDOW_BYTES]
    return max(fits, default=1)


def agreed_size(counts: Sequence[float]) -> int:
    """The smallest size proposed: ``counts`` holds how many ranks proposed each level."""
    return next((level for level, count in zip(LEVELS, counts) if count), LEVELS[0])


def _nbytes(element: Any) -> int:
    """About how many bytes ``element`` holds (strings in object arrays counted), 0 for what
    cannot be sized: it only bounds a window."""
    try:
        return sum(map(_leaf_bytes, nest.flatten(element)))
    except Exception:  # noqa: BLE001 - a leaf that cannot be sized: it stops nothing
        return 0


def _leaf_bytes(leaf: Any) -> int:
    if isinstance(leaf, (bytes, bytearray, str)):
        return len(leaf)
    size = int(getattr(leaf, "nbytes", 0) or 0)
    if getattr(leaf, "dtype", None) == object:
        size += sum(len(v) for v in leaf.flat if isinstance(v, (bytes, bytearray, str)))
    return size


class Lockstep:
    """The agreed steps of one rank's stream.

    ``pull()`` gives this rank's next ``(element, failure)`` (``end`` once it has none left;
    a step after a failure is never served), ``flags_of(element, failure)`` its flags (a list
    of bools, as long at every step), and ``count(flags)`` how many ranks raise each flag
    (collective; all ranks call it with the same length). ``grow``: whether windows may hold
    more than one step (not worth it without other ranks)."""

    def __init__(self, pull: Callable[[], Tuple[Any, Any]], flags_of: Callable[[Any, Any], list],
                 count: Callable[[list], Any], end: Any, grow: bool = True):
        self._pull, self._flags_of, self._count, self._end = pull, flags_of, count, end
        self._grow = grow
        self._ahead: deque = deque()
        self._size = 1

    def next(self) -> Tuple[Any, Any, List[float]]:
        """This rank's next step, its failure and the counts of every flag over the ranks."""
        if not self._ahead:
            self._fill()
        return self._ahead.popleft()

    def clear(self) -> None:
        """Forget what was read ahead (the stream moved: a restore); start with one step."""
        self._ahead.clear()
        self._size = 1

    def _fill(self) -> None:
        steps, flags, largest, done = [], [], 0, False
        start = time.perf_counter()
        for _ in range(self._size):
            element, failure = (self._end, None) if done else self._pull()
            done = element is self._end or failure is not None
            if self._grow and not done:
                largest = max(largest, _nbytes(element))
            steps.append((element, failure))
            flags.append(self._flags_of(element, failure))
        width, proposal = len(flags[0]), []
        if self._grow:   # and the next window's size: one vote per rank
            pace = (time.perf_counter() - start) / self._size
            proposal = [0.0] * len(LEVELS)
            proposal[LEVELS.index(window_size(self._size, pace, largest))] = 1.0
        counts = list(self._count([f for step in flags for f in step] + proposal))
        if self._grow:
            self._size = agreed_size(counts[-len(LEVELS):])
        for k, (element, failure) in enumerate(steps):
            self._ahead.append((element, failure, counts[k * width:(k + 1) * width]))
