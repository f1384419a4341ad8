"""The operations a ``Dataset`` is made of: sources and transformations as nodes.

Each node iterates its elements for one iteration (``elements(it)``), and,
when every node below it allows, makes a random-access plan of that iteration
(``plan(it)``, see ``plans.py``) instead. An ``Iteration`` names the iteration
(its *path*: the epoch, then one repetition index per ``repeat`` above) and
the seeds the ranks agreed on, so the same path gives the same elements on
every rank and in every process, and nothing depends on how many iterators
were made before::

    >>> import numpy as np
    >>> from mpistrat.data.ops import Iteration, Source, Batch
    >>> from mpistrat.data.shuffles import GlobalShuffle
    >>> source = Source(6, lambda idx: idx * 10, "range")
    >>> batches = Batch(GlobalShuffle(source, seed=1, reshuffle=True), 4, False)
    >>> epoch = [b.tolist() for b in batches.elements(Iteration((0,)))]
    >>> sorted(sum(epoch, [])) == [0, 10, 20, 30, 40, 50], [len(b) for b in epoch]
    (True, [4, 2])
    >>> epoch == [b.tolist() for b in batches.elements(Iteration((0,)))]  # same path, same order
    True
"""

import itertools
from typing import Any, Callable, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from mpistrat import nest
from mpistrat.data import mapping, plans
from mpistrat.data.rows import Rows, stack_elements
from mpistrat.data.threads import prefetched

__all__ = ["INFINITE", "UNKNOWN", "Iteration", "Node", "Source", "Generator", "Map", "Filter",
           "Repeat", "IndexSlice", "Enumerate", "Zip", "Batch", "Unbatch", "Prefetch", "walk"]

INFINITE, UNKNOWN = -1, -2


class Iteration(NamedTuple):
    """Which iteration: ``path`` (epoch, then repetitions) and agreed ``seeds`` by node id."""

    path: Tuple[int, ...]
    seeds: Mapping[int, int] = {}

    def child(self, repetition: int) -> "Iteration":
        return Iteration(self.path + (repetition,), self.seeds)

    def seed_for(self, node: "Node") -> int:
        if node.seed is not None:
            return node.seed
        return self.seeds.get(id(node), node.fallback_seed)


class Node:
    """One operation; ``inputs`` are the nodes it reads."""

    inputs: Tuple["Node", ...] = ()
    batch_size: Optional[int] = None     # elements are batches of this many rows
    drop_remainder = False
    seed: Optional[int] = None           # random operations only
    name = "operation"

    def blocker(self) -> Optional[str]:
        """Why this node has no random access (the operation that prevents it), or ``None``."""
        for node in self.inputs:
            reason = node.blocker()
            if reason:
                return reason
        return None

    def cardinality(self) -> int:
        return self.inputs[0].cardinality() if self.inputs else UNKNOWN

    def plan(self, it: Iteration) -> Optional[plans.Plan]:
        return None

    def sequential(self, it: Iteration) -> Iterator[Any]:
        raise NotImplementedError

    def elements(self, it: Iteration) -> Iterator[Any]:
        plan = self.plan(it) if self.blocker() is None else None
        return iterate_plan(plan) if plan is not None else self.sequential(it)


def walk(root: Node) -> List[Node]:
    """Every node under ``root`` once, in a fixed order (depth first, inputs in order)."""
    seen, order, todo = set(), [], [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        todo.extend(reversed(node.inputs))
    return order


def iterate_plan(plan: plans.Plan, start: int = 0) -> Iterator[Any]:
    """The elements of a plan in order from ``start``, asked for in growing groups (the
    first comes fast)."""
    group, position = 1, start
    while plan.length is None or position < plan.length:
        stop = position + group if plan.length is None else min(position + group, plan.length)
        if plan.batched:
            yield from plan.batches(range(position, stop))
            group = min(group * 2, 16)
        else:
            yield from plan.gather(np.arange(position, stop, dtype=np.int64)).elements()
            group = min(group * 2, 1024)
        position = stop


# -- sources ---------------------------------------------------------------------------
class Source(Node):
    """``length`` rows; ``gather(indices)`` returns them stacked (range, slices, readers)."""

    reader = None   # the file reader, for sources that read files (their views are agreed)

    def __init__(self, length: int, gather: Callable[[np.ndarray], Any], name: str,
                 row_bytes: int = 0):
        self.length, self._gather, self.name = length, gather, name
        self.row_bytes = row_bytes  # bytes read per row (0: in memory)

    def cardinality(self):
        return self.length

    def plan(self, it):
        return plans.SourcePlan(self.length, self._gather, reads=self.row_bytes > 0)


class Generator(Node):
    """Elements from ``make_iter()``: no random access (``Dataset(make_iter)``)."""

    name = "a generator-based dataset"

    def __init__(self, make_iter: Callable[[], Iterator], batch_size=None, drop_remainder=False):
        self._make_iter = make_iter
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def blocker(self):
        return self.name

    def sequential(self, it):
        return iter(self._make_iter())


# -- transformations -------------------------------------------------------------------
class Unary(Node):
    def __init__(self, input_: Node):
        self.inputs = (input_,)
        self.batch_size, self.drop_remainder = input_.batch_size, input_.drop_remainder

    @property
    def input(self) -> Node:
        return self.inputs[0]


class Map(Unary):
    """``map(fn)``; ``vectorized``: ``fn`` takes stacked rows and treats each row alone."""

    name = "map"

    def __init__(self, input_, fn: Callable, vectorized: bool, workers: int):
        super().__init__(input_)
        self.fn, self.vectorized, self.workers = fn, vectorized, workers

    def plan(self, it):
        child = self.input.plan(it)
        if child.batched:
            return plans.MapBatches(child, self.fn, self.vectorized, self.workers)
        return plans.MapRows(child, self.fn, self.vectorized, self.workers)

    def sequential(self, it):
        if not self.vectorized or self.batch_size is not None:
            return (mapping.apply(self.fn, e) for e in self.input.elements(it))
        return self._chunked(it)

    def _chunked(self, it):
        elements = self.input.elements(it)
        while True:
            chunk = list(itertools.islice(elements, 256))
            if not chunk:
                return
            yield from mapping.map_stacked(self.fn, Rows.stacked_as(stack_elements(chunk),
                                                                  len(chunk)), 1).elements()


class Filter(Unary):
    name = "filter"

    def __init__(self, input_, predicate: Callable):
        super().__init__(input_)
        self.predicate = predicate

    def blocker(self):
        return "filter (its output length depends on the values)"

    def cardinality(self):
        return UNKNOWN

    def sequential(self, it):
        return (e for e in self.input.elements(it) if bool(mapping.apply(self.predicate, e)))


class Repeat(Unary):
    name = "repeat"

    def __init__(self, input_, count: Optional[int]):
        super().__init__(input_)
        self.count = None if count is None or count < 0 else int(count)

    def cardinality(self):
        n = self.input.cardinality()
        if n == 0 or self.count == 0:
            return 0
        if n == INFINITE or self.count is None:
            return INFINITE
        return UNKNOWN if n == UNKNOWN else n * self.count

    def plan(self, it):
        if self.input.cardinality() == INFINITE:
            return self.input.plan(it.child(0))
        return plans.Repeat(lambda r: self.input.plan(it.child(r)), self.count)

    def sequential(self, it):
        for repetition in (itertools.count() if self.count is None else range(self.count)):
            yield from self.input.elements(it.child(repetition))


class IndexSlice(Unary):
    """``take`` (``[:n]``), ``skip`` (``[n:]``) and ``shard`` (``[i::n]``): index arithmetic."""

    def __init__(self, input_, start: int, stop: Optional[int], step: int, name: str):
        super().__init__(input_)
        self.start, self.stop, self.step, self.name = start, stop, step, name

    def cardinality(self):
        n = self.input.cardinality()
        if n >= 0:
            return len(range(n)[self.start:self.stop:self.step])
        if n == INFINITE:
            return INFINITE if self.stop is None else len(range(self.start, self.stop, self.step))
        return UNKNOWN

    def plan(self, it):
        child = self.input.plan(it)
        n = self.cardinality()
        start, step = self.start, self.step
        return plans.Remap(child, None if n == INFINITE else n, lambda p: start + p * step)

    def sequential(self, it):
        return itertools.islice(self.input.elements(it), self.start, self.stop, self.step)


class Enumerate(Unary):
    name = "enumerate"

    def __init__(self, input_, start: int):
        super().__init__(input_)
        self.start = int(start)

    def blocker(self):
        if self.input.batch_size is not None:
            return "enumerate of batches"
        return self.input.blocker()

    def plan(self, it):
        return plans.EnumerateRows(self.input.plan(it), self.start)

    def sequential(self, it):
        return ((np.asarray(i, np.int64), e)
                for i, e in enumerate(self.input.elements(it), self.start))


class Zip(Node):
    name = "zip"

    def __init__(self, structure: Any, inputs: List[Node]):
        self.structure, self.inputs = structure, tuple(inputs)

    def blocker(self):
        if any(node.batch_size is not None for node in self.inputs):
            return "zip of batched datasets"
        return super().blocker()

    def cardinality(self):
        counts = [node.cardinality() for node in self.inputs]
        if all(c == INFINITE for c in counts):
            return INFINITE
        if UNKNOWN in counts:
            return UNKNOWN
        return min(c for c in counts if c >= 0)

    def plan(self, it):
        return plans.ZipRows([node.plan(it) for node in self.inputs], self.structure)

    def sequential(self, it):
        return (nest.pack_sequence_as(self.structure, list(items))
                for items in zip(*[node.elements(it) for node in self.inputs]))


class Batch(Unary):
    name = "batch"

    def __init__(self, input_, batch_size: int, drop_remainder: bool):
        super().__init__(input_)
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size, self.drop_remainder = int(batch_size), bool(drop_remainder)

    def blocker(self):
        if self.input.batch_size is not None:
            return "batch of batches"
        return self.input.blocker()

    def cardinality(self):
        n = self.input.cardinality()
        if n < 0:
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def plan(self, it):
        return plans.BatchRows(self.input.plan(it), self.batch_size, self.drop_remainder)

    def sequential(self, it):
        elements = self.input.elements(it)
        while True:
            chunk = list(itertools.islice(elements, self.batch_size))
            if not chunk or (self.drop_remainder and len(chunk) < self.batch_size):
                return
            yield stack_elements(chunk)


class Unbatch(Unary):
    name = "unbatch"

    def __init__(self, input_):
        super().__init__(input_)
        self.batch_size, self.drop_remainder = None, False

    def blocker(self):
        return "unbatch (its output length depends on the batches)"

    def cardinality(self):
        return INFINITE if self.input.cardinality() == INFINITE else UNKNOWN

    def sequential(self, it):
        for element in self.input.elements(it):
            leaves = nest.flatten(element)
            for i in range(len(leaves[0]) if leaves else 0):
                yield nest.pack_sequence_as(element, [leaf[i] for leaf in leaves])


class Prefetch(Unary):
    """``prefetch(depth)``: a thread keeps ``depth`` elements ready; transparent to plans
    (a distributed dataset prefetches its own rows with the depth found here)."""

    name = "prefetch"

    def __init__(self, input_, depth: int):
        super().__init__(input_)
        self.depth = int(depth)

    def plan(self, it):
        return self.input.plan(it)

    def elements(self, it):
        return prefetched(self.input.elements(it), self.depth)
