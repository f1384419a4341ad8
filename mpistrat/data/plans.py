"""Random-access plans: one iteration of a pipeline, addressed by element index.

A *row plan* answers ``gather(indices) -> Rows`` for elements that are rows;
a *batch plan* answers ``size(i)`` (rows of batch ``i``) and
``rows([(i, start, stop), ...])`` (rows ``start:stop`` of batch ``i``). Index
transformations (``take``, ``skip``, ``shard``, the shuffles, ``repeat``)
only rewrite indices; ``map`` runs on exactly the rows asked for; a reader
reads exactly those. So a rank asks for its rows of a global batch and pays
for nothing else, and any step of any epoch is one computation away::

    >>> import numpy as np
    >>> from mpistrat.data.plans import SourcePlan, Remap, BatchRows
    >>> squares = SourcePlan(10, lambda idx: idx * idx)
    >>> batches = BatchRows(Remap(squares, 5, lambda p: p + 5), 2, drop_remainder=False)
    >>> [batches.size(i) for i in range(batches.length)]
    [2, 2, 1]
    >>> batches.rows([(1, 1, 2)])[0].stack().tolist()
    [64]
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mpistrat import nest
from mpistrat.data.held_rows import Held, sorted_unique
from mpistrat.data.mapping import apply, as_leaf, map_stacked, parallel_map
from mpistrat.data.rows import Rows

__all__ = ["Plan", "SourcePlan", "MapRows", "ZipRows", "EnumerateRows", "Remap", "Repeat",
           "BatchRows", "MapBatches"]

Request = Tuple[int, int, int]   # (batch index, first row, stop row)


class Plan:
    """Common part: ``length`` (``None`` when infinite) and whether elements are batches."""

    length: Optional[int] = None
    batched = False

    def gather(self, indices: np.ndarray) -> Rows:
        raise TypeError("elements of this plan are batches: ask for rows of a batch")

    def size(self, index: int) -> int:
        raise TypeError("elements of this plan are rows, not batches")

    def rows(self, requests: Sequence[Request]) -> List[Rows]:
        raise TypeError("elements of this plan are rows, not batches")

    def batches(self, indices: Sequence[int]) -> List[Any]:
        """Whole elements ``indices`` of a batch plan (what iterating the dataset yields)."""
        return [rows.stack() for rows in self.rows([(i, 0, self.size(i)) for i in indices])]

    def need(self, wanted) -> None:
        """Read ahead what ``gather(wanted)`` (row plans: indices) or ``rows(wanted)``
        (batch plans: requests) will read: sources read it now, sorted and coalesced, and
        serve the next gathers from memory. Plans that read nothing ignore it."""


def _take(leaf: Any, where: np.ndarray) -> Any:
    """Rows ``where`` of a held leaf (``ndarray.take`` copies whole rows: faster than
    indexing for records)."""
    return leaf.take(where, axis=0) if type(leaf) is np.ndarray else leaf[where]


class SourcePlan(Plan):
    """``gather_stacked(indices)`` returns the stacked rows at ``indices`` (any order).

    ``reads=True`` (file readers): ``need`` reads the rows asked for in one sorted pass
    and keeps them until the next ``need``; gathers of rows held are served from there."""

    def __init__(self, length: int, gather_stacked: Callable[[np.ndarray], Any],
                 reads: bool = False):
        self.length, self._gather, self._reads = length, gather_stacked, reads
        self._held: Optional[Held] = None
        self._rows: Any = None

    def need(self, wanted):
        if not self._reads:
            return
        self._held = self._rows = None              # free the previous window first
        indices = sorted_unique(wanted)
        self._rows = self._gather(indices)
        self._held = Held(indices, self.length)

    def gather(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        where = self._held.find(indices) if self._held is not None else None
        if where is not None:
            return Rows.stacked_as(nest.map_structure(lambda l: _take(l, where), self._rows),
                                   len(indices))
        return Rows.stacked_as(self._gather(indices), len(indices))


class MapRows(Plan):
    """``map(fn)`` over rows: row by row (a list), or once per request (``vectorized``)."""

    def __init__(self, child: Plan, fn: Callable, vectorized: bool, workers: int):
        self.child, self.fn, self.vectorized, self.workers = child, fn, vectorized, workers
        self.length = child.length

    def need(self, wanted):
        self.child.need(wanted)

    def gather(self, indices):
        rows = self.child.gather(indices)
        if self.vectorized:
            return map_stacked(self.fn, rows, self.workers)
        return Rows.of_items(parallel_map(lambda e: apply(self.fn, e), rows.elements(),
                                          self.workers))


class ZipRows(Plan):
    """Rows of several plans side by side, as ``structure`` (shortest length)."""

    def __init__(self, children: List[Plan], structure: Any):
        self.children, self.structure = children, structure
        finite = [c.length for c in children if c.length is not None]
        self.length = min(finite) if finite else None

    def need(self, wanted):
        for child in self.children:
            child.need(wanted)

    def gather(self, indices):
        parts = [c.gather(indices) for c in self.children]
        if all(p.is_stacked for p in parts):
            return Rows.stacked_as(nest.pack_sequence_as(self.structure,
                                                         [p.stacked for p in parts]), len(indices))
        columns = [p.elements() for p in parts]
        return Rows.of_items([nest.pack_sequence_as(self.structure, list(row))
                              for row in zip(*columns)])


class EnumerateRows(Plan):
    """``(start + index, element)`` pairs."""

    def __init__(self, child: Plan, start: int):
        self.child, self.start, self.length = child, start, child.length

    def need(self, wanted):
        self.child.need(wanted)

    def gather(self, indices):
        rows = self.child.gather(indices)
        counter = np.asarray(indices, dtype=np.int64) + self.start
        if rows.is_stacked:
            return Rows.stacked_as((counter, rows.stacked), rows.count)
        return Rows.of_items([(counter[i, ...], e) for i, e in enumerate(rows.elements())])


class Remap(Plan):
    """Element ``p`` is the child's element ``forward(p)`` (take, skip, shard, shuffles)."""

    def __init__(self, child: Plan, length: Optional[int], forward: Callable[[np.ndarray], np.ndarray]):
        self.child, self.length, self.forward = child, length, forward
        self.batched = child.batched

    def _one(self, index: int) -> int:
        return int(self.forward(np.array([index], dtype=np.int64))[0])

    def _mapped(self, requests):
        mapped = self.forward(np.array([r[0] for r in requests], dtype=np.int64)).tolist()
        return [(i, a, b) for i, (_, a, b) in zip(mapped, requests)]

    def need(self, wanted):
        if self.batched:
            self.child.need(self._mapped(wanted) if wanted else [])
            return
        positions = sorted_unique(wanted)
        self._memo = (Held(positions, self.length), self.forward(positions))  # once per window
        self.child.need(self._memo[1])

    def _forward(self, indices: np.ndarray) -> np.ndarray:
        memo = getattr(self, "_memo", None)
        where = memo[0].find(indices) if memo is not None else None
        return self.forward(indices) if where is None else memo[1][where]

    def gather(self, indices):
        return self.child.gather(self._forward(np.asarray(indices, dtype=np.int64)))

    def size(self, index):
        return self.child.size(self._one(index))

    def rows(self, requests):
        return self.child.rows(self._mapped(requests)) if requests else []

    def batches(self, indices):
        if not len(indices):
            return []
        return self.child.batches(self.forward(np.asarray(indices, dtype=np.int64)).tolist())


class Repeat(Plan):
    """``repeat(count)``: repetition ``r`` is the child plan made for iteration ``r``; endless
    (``length`` ``None``) for ``count`` ``None`` or negative (tf.data's ``repeat(-1)``).
    Child plans are made when a repetition is first asked for, never ahead, and the last
    ``KEPT`` of them are kept."""

    KEPT = 4

    def __init__(self, make_child: Callable[[int], Plan], count: Optional[int]):
        self._make, self._cache = make_child, {}
        first = self._child(0)
        self.batched = first.batched
        self._each = first.length
        if self._each is None:
            raise ValueError("repeat of an infinite dataset")
        self.length = None if count is None or count < 0 else self._each * int(count)
        if self._each == 0:
            self.length = 0

    def _child(self, repetition: int) -> Plan:
        plan = self._cache.get(repetition)
        if plan is None:
            if len(self._cache) >= self.KEPT:
                self._cache.pop(next(iter(self._cache)))
            plan = self._cache[repetition] = self._make(repetition)
        return plan

    def need(self, wanted):
        """Read ahead for the first ``KEPT`` repetitions asked for only: rows read for later
        ones would be dropped with their child plans before use (a window of a short input
        repeated spans many repetitions)."""
        if self.batched:
            groups: Dict[int, list] = {}
            for index, a, b in wanted:
                repetition, local = divmod(index, self._each)
                if repetition in groups or len(groups) < self.KEPT:
                    groups.setdefault(repetition, []).append((local, a, b))
        else:
            reps, local = np.divmod(np.asarray(wanted, dtype=np.int64), self._each)
            groups = {r: local[reps == r] for r in np.unique(reps)[:self.KEPT].tolist()}
        for repetition, part in groups.items():
            self._child(repetition).need(part)

    def gather(self, indices):
        indices = np.asarray(indices, dtype=np.int64)
        reps, local = np.divmod(indices, self._each)
        first = int(reps[0]) if len(reps) else 0
        if not len(reps) or (reps == first).all():
            return self._child(first).gather(local)
        parts, order = [], []
        for repetition in np.unique(reps).tolist():
            where = np.flatnonzero(reps == repetition)
            parts.append(self._child(repetition).gather(local[where]))
            order.append(where)
        joined = Rows.concat(parts)
        return joined.take(np.argsort(np.concatenate(order), kind="stable"))

    def size(self, index):
        repetition, local = divmod(index, self._each)
        return self._child(repetition).size(local)

    def rows(self, requests):
        out = []
        for index, a, b in requests:
            repetition, local = divmod(index, self._each)
            out.extend(self._child(repetition).rows([(local, a, b)]))
        return out

    def batches(self, indices):
        out = []
        for index in indices:
            repetition, local = divmod(index, self._each)
            out.extend(self._child(repetition).batches([local]))
        return out


class BatchRows(Plan):
    """``batch(size)`` over a row plan: rows of several requests are gathered at once."""

    batched = True

    def __init__(self, child: Plan, batch_size: int, drop_remainder: bool):
        self.child, self.batch_size = child, batch_size
        n = child.length
        if n is None:
            self.length = None
        else:
            self.length = n // batch_size if drop_remainder else -(-n // batch_size)

    def size(self, index):
        n = self.child.length
        start = index * self.batch_size
        return self.batch_size if n is None else max(0, min(self.batch_size, n - start))

    def _indices(self, requests):
        counts = [max(b - a, 0) for _, a, b in requests]
        spans = [np.arange(i * self.batch_size + a, i * self.batch_size + a + c, dtype=np.int64)
                 for (i, a, _), c in zip(requests, counts)]
        if len(spans) == 1:
            return spans[0], counts
        return np.concatenate(spans) if spans else np.empty(0, np.int64), counts

    def need(self, wanted):
        self.child.need(self._indices(wanted)[0])

    def rows(self, requests):
        if not requests:
            return []
        indices, counts = self._indices(requests)
        return self.child.gather(indices).split(counts)


class MapBatches(Plan):
    """``map(fn)`` over batches. ``rowwise`` (``vectorized=True``): ``fn`` of some rows is
    those rows of ``fn`` of the batch, so a rank maps only its rows; otherwise the whole
    batch is made and mapped, then cut (the last few kept, as ranks ask for their slices)."""

    batched = True

    def __init__(self, child: Plan, fn: Callable, rowwise: bool, workers: int):
        self.child, self.fn, self.rowwise, self.workers = child, fn, rowwise, workers
        self.length = child.length
        self._made: Dict[int, Any] = {}

    def _mapped(self, index: int) -> Any:
        batch = self._made.get(index)
        if batch is None:
            if len(self._made) >= 8:
                self._made.pop(next(iter(self._made)))
            batch = self._made[index] = nest.map_structure(
                as_leaf, apply(self.fn, self.child.batches([index])[0]))
        return batch

    def size(self, index):
        if self.rowwise:
            return self.child.size(index)
        leaves = nest.flatten(self._mapped(index))
        if not leaves or any(np.ndim(leaf) == 0 for leaf in leaves):
            raise ValueError("a distributed dataset cuts every batch into per-replica slices, "
                             "but the map after batch returned values without a batch "
                             "dimension")
        return int(np.shape(leaves[0])[0])

    def need(self, wanted):
        self.child.need(wanted if self.rowwise else
                        [(i, 0, self.child.size(i)) for i in sorted({r[0] for r in wanted})])

    def rows(self, requests):
        if self.rowwise:
            return parallel_map(lambda part: map_stacked(self.fn, part, 1, rowwise=False),
                                self.child.rows(requests), self.workers)
        return [Rows.stacked_as(self._mapped(i), self.size(i)).slice(a, b)
                for i, a, b in requests]

    def batches(self, indices):
        return parallel_map(lambda batch: apply(self.fn, batch), self.child.batches(indices),
                            self.workers)
