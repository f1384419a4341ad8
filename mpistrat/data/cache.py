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
midway keeps nothing, as tf.data discards a partial cache).

*Saved with the iterator.* As tf.data saves a memory cache in its iterator's checkpoint (the
whole cache once complete, else the elements so far with its input's position), a
distributed iterator saves what this rank's caches hold (``contents``: the rows it computed,
or the elements of the iteration so far; ``cache_state.py``), and a restore puts them back
(``load``, replacing what the cache held) before the iterator goes on: a resumed iterator
yields the cached elements, bit for bit, and never runs the map below again for them, so a
map that is not deterministic (a random generator without a seed) gives what the run that
never stopped gave. A sequential iteration restored midway yields the saved elements, then
reads its input on from there (its first elements are read again and dropped)::

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
    >>> resumed = Cache(source)        # as in a new process: nothing cached yet
    >>> resumed.load(cached.contents())
    >>> [int(x) for x in resumed.elements(Iteration((2,)))], len(calls)
    ([0, 10, 20, 30], 4)
"""

import itertools
import threading
from typing import Any, Dict, List, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data import ops, plans
from mpistrat.data.cache_state import Contents
from mpistrat.data.rows import Rows

__all__ = ["Cache"]


class Cache(ops.Unary):
    """``cache()`` in memory (``cache(filename)`` is refused by ``Dataset.cache``)."""

    name = "cache"

    def __init__(self, input_: ops.Node):
        super().__init__(input_)
        self._plan: Optional["_Memo"] = None
        self._elements: Optional[List[Any]] = None      # the sequential path's, complete
        self._filling: Optional[List[Any]] = None       # the sequential iteration under way
        self._resume: Optional[List[Any]] = None        # restored: an iteration's beginning
        self._restored: Optional[Contents] = None       # restored before the plan was made
        self._generation = 0                            # restores so far
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
                if self._restored is not None:
                    self._plan.load(self._restored)
                    self._restored = None
            return self._plan

    def sequential(self, it):
        with self._lock:
            complete, generation = self._elements, self._generation
            kept = list(self._resume or ())
            if complete is None:
                self._filling = kept
        if complete is not None:
            yield from complete
            return
        resumed, done = len(kept), False
        try:
            yield from kept[:resumed]        # restored: as the saved iteration yielded them
            for element in itertools.islice(self.input.elements(self._first(it)), resumed,
                                            None):
                kept.append(_owned(element))
                yield element
            done = True
        finally:
            with self._lock:
                if done and generation == self._generation and self._elements is None:
                    self._elements, self._resume = kept, None
                if self._filling is kept:
                    self._filling = None

    # -- saved with an iterator ----------------------------------------------------------
    def contents(self) -> Contents:
        """What this cache holds now, in this process (a snapshot)."""
        with self._lock:
            plan, restored, complete = self._plan, self._restored, self._elements
            partial = max([list(self._filling or ()), list(self._resume or ())], key=len)
        if plan is not None:
            return plan.contents()
        if restored is not None:
            return restored
        if complete is not None:
            return Contents(elements=complete, complete=True)
        return Contents(elements=partial) if partial else Contents()

    def load(self, contents: Contents) -> None:
        """Hold ``contents`` instead of what this cache held (tf.data's restore resets the
        cache, then fills it from the checkpoint); every iterator of the dataset sees them.
        Iterations under way when it is called keep nothing."""
        with self._lock:
            self._generation += 1
            self._filling = None
            whole = contents.complete and contents.elements is not None
            self._elements = contents.elements if whole else None
            self._resume = None if whole else contents.elements
            planned = bool(contents.rows or contents.slices or contents.sizes)
            if self._plan is not None:
                self._plan.load(contents)
            else:
                self._restored = contents if planned else None


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

    def contents(self) -> Contents:
        with self._lock:
            return Contents(rows=self._rows, slices=self._slices, sizes=self._sizes)

    def load(self, contents: Contents) -> None:
        with self._lock:
            self._rows = dict(contents.rows)
            self._slices = dict(contents.slices)
            self._sizes = dict(contents.sizes)

    def _whole(self, key: tuple) -> Optional[Rows]:
        """Rows ``a:b`` of batch ``i`` cut from the whole batch, if it is held (another
        consumer asked for all of it, or slices restored from another width were joined)."""
        index, start, stop = key
        size = self._sizes.get(index)
        whole = None if size is None or key == (index, 0, size) else \
            self._slices.get((index, 0, size))
        return None if whole is None else whole.slice(start, stop)

    def _need(self, wanted):
        if self.batched:
            missing = [tuple(r) for r in wanted if tuple(r) not in self._slices
                       and self._whole(tuple(r)) is None]
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
        found = {}
        for key in dict.fromkeys(keys):
            held = self._slices.get(key)
            held = self._whole(key) if held is None else held
            if held is not None:
                found[key] = held
        missing = [k for k in dict.fromkeys(keys) if k not in found]
        if missing:
            made = list(map(_owned_rows, self.child.rows(missing)))
            self._slices.update(zip(missing, made))
            found.update(zip(missing, made))
        return [found[k] for k in keys]


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
