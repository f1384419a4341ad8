"""Rows read ahead: which indices a plan holds in memory, and where each one is.

    >>> import numpy as np
    >>> from mpistrat.data.held_rows import Held, sorted_unique
    >>> held = Held(sorted_unique([9, 2, 5, 2]), universe=10)
    >>> held.find(np.array([5, 9])).tolist(), held.find(np.array([3]))
    ([1, 2], None)
"""

from typing import Optional

import numpy as np

__all__ = ["Held", "sorted_unique"]


def sorted_unique(values) -> np.ndarray:
    """``np.unique`` of int64 values by one sort (already sorted input: no copy kept)."""
    values = np.asarray(values, dtype=np.int64)
    if values.size < 2:
        return values
    steps = np.diff(values)
    if (steps > 0).all():
        return values
    values = np.sort(values)
    keep = np.empty(values.size, dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]



class Held:
    """Sorted unique ``indices`` held in memory, and where each one is (``find``): a table
    over the whole index range when that is small, else a binary search."""

    TABLE_LIMIT = 1 << 24

    def __init__(self, indices: np.ndarray, universe: Optional[int]):
        self.indices = indices
        self._table = None
        if universe is not None and universe <= self.TABLE_LIMIT and indices.size:
            self._table = np.full(universe, -1, dtype=np.int64)
            self._table[indices] = np.arange(indices.size)

    def find(self, query: np.ndarray) -> Optional[np.ndarray]:
        """Positions of ``query`` among the held indices, or ``None`` if one is missing."""
        if not self.indices.size or not query.size:
            return None
        if self._table is not None:
            if query.min() < 0:
                return None
            try:
                where = self._table[query]
            except IndexError:   # beyond the index range
                return None
            return where if where.min() >= 0 else None
        where = np.minimum(np.searchsorted(self.indices, query), self.indices.size - 1)
        return where if (self.indices[where] == query).all() else None
