"""``Dataset.cache()``: the elements of the input's first iteration, kept in memory.

As in tf.data, every iteration of a cached dataset yields the elements of its first
iteration: a ``shuffle`` *below* ``cache`` is frozen (the same order every epoch), one above
it reshuffles the cached elements; a ``map`` below it runs once per element. The first
iteration is the one at the iteration path of zeros (epoch 0, repetition 0), whichever is
asked first, so an iterator resumed at epoch 3 sees the same elements as the run that never
stopped. Random access is kept: with a plan below, only the rows (or the slices of batches)
that this process asks for are computed and kept, so each rank of a distributed dataset
keeps its own rows; under a reshuffle *above* the cache each epoch deals other rows to a
rank, which over the epochs computes and keeps every row it is dealt (up to the whole
dataset, as every tf.data worker caches its whole input). Without a plan, the elements are kept as they
are yielded, and kept only once an iteration reached the end (an iteration abandoned
midway keeps nothing, as tf.data discards a partial cache)::

    >>> import numpy as np
    >>> from mpistrat.data.ops import Iteration, Source, Map
    >>> calls = []
    >>> source = Map(Source(4, lambda idx: idx, "range"),
    ...              lambda x: calls.append(int(x)) or x * 10, False, 1)
    >>> cached = Cache(source)
    >>> [int(x) for x in cached.elements(Iteration((0,)))]
    [0, 10, 20, 30]
    >>> [int(x) for x in cached.elements(Iteration((1,)))], calls
    ([0, 10, 20, 30], [0, 1, 2, 3])
"""

import threading
from typing import Any, Dict, List, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data import ops, plans
from mpistrat.data.rows import Rows

__all__ = ["Cache"]


class Cache(ops.Unary):
    """``cache()`` in memory (``cache(filename)`` is refused by ``Dataset.cache``)."""

    name = "cache"

    def __init__(self, input_: ops.Node):
        super().__init__(input_)
        self._plan: Optional["_Memo"] = None
        self._elements: Optional[List[Any]] = None      # the sequential path's, complete
        self._lock = threading.Lock()

    @staticmethod
    def _first(it: ops.Iteration) -> ops.Iteration:
        return ops.Iteration((0,) * len(it.path), it.seeds)

    def plan(self, it):
        with self._lock:
            if self._plan is None:
                child = self.input.plan(self._first(it))
                if child is None:
                    return None
                self._plan = _Memo(child)
            return self._plan

    def sequential(self, it):
        if self._elements is not None:
            yield from self._elements
            return
        kept = []
        for element in self.input.elements(self._first(it)):
            kept.append(_owned(element))
            yield element
        self._elements = kept


class _Memo(plans.Plan):
    """A plan that computes each row (row plans), each requested slice of a batch and each
    batch's size (batch plans) once, and serves them from memory afterwards. Every iterator of
    the dataset shares it (and the one child plan below, whose read-ahead window is state):
    one at a time, under a lock."""

    def __init__(self, child: plans.Plan):
        self.child, self.length, self.batched = child, child.length, child.batched
        self._rows: Dict[int, Any] = {}
        self._slices: Dict[tuple, Rows] = {}
        self._sizes: Dict[int, int] = {}
        self._lock = threading.RLock()

    def need(self, wanted):
        with self._lock:
            self._need(wanted)

    def _need(self, wanted):
        if self.batched:
            missing = [tuple(r) for r in wanted if tuple(r) not in self._slices]
        else:
            missing = [i for i in np.asarray(wanted, dtype=np.int64).tolist()
                       if i not in self._rows]
        if missing:
            self.child.need(missing if self.batched else np.asarray(missing, dtype=np.int64))

    def gather(self, indices):
        with self._lock:
            return self._gather(indices)

    def _gather(self, indices):
        indices = np.asarray(indices, dtype=np.int64).tolist()
        missing = sorted({i for i in indices if i not in self._rows})
        if missing:
            found = _owned_rows(self.child.gather(np.asarray(missing, dtype=np.int64)))
            self._rows.update(zip(missing, found.elements()))
        return Rows.of_items([self._rows[i] for i in indices])

    def size(self, index):
        with self._lock:     # (a map after batch would run again just to count the rows)
            if index not in self._sizes:
                self._sizes[index] = self.child.size(index)
            return self._sizes[index]

    def rows(self, requests):
        with self._lock:
            return self._rows_of(requests)

    def _rows_of(self, requests):
        keys = [tuple(int(v) for v in r) for r in requests]
        missing = [k for k in dict.fromkeys(keys) if k not in self._slices]
        if missing:
            self._slices.update(zip(missing, map(_owned_rows, self.child.rows(missing))))
        return [self._slices[k] for k in keys]


def _frozen(leaf: Any) -> Any:
    if not isinstance(leaf, np.ndarray):
        return leaf
    leaf = leaf.copy()
    leaf.flags.writeable = False
    return leaf


def _owned(element: Any) -> Any:
    """A read-only copy of the arrays of ``element``: a reader may reuse the memory of what
    it gave, and a caller writing into a batch it was given must not change the cache (it
    gets NumPy's "assignment destination is read-only" instead, as tf.data's tensors are
    immutable)."""
    return nest.map_structure(_frozen, element)


def _owned_rows(rows: Rows) -> Rows:
    if rows.is_stacked:
        return Rows.stacked_as(_owned(rows.stacked), rows.count)
    return Rows.of_items([_owned(e) for e in rows.items])
