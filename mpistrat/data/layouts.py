"""Which rows a rank yields at each step, per sharding policy, and from where it resumes.

A *layout* turns a dataset into this rank's stream of steps: each step is a
tuple of components (one per local replica), ``NO_LAYOUT`` (a 0-row slice
whose dtypes this rank cannot know: the iterator fills it in), and the stream
ends when the data does. ``local_steps(it, start)`` starts at any step:

* ``DataLayout``: TensorFlow's rebatch rule (``rebatch_slices``) on every
  global batch. Over a random-access pipeline the rank asks the plan for its
  rows of several global batches at once (one index computation, one read,
  one vectorised map), and starting at step ``k`` costs what step 0 does;
  otherwise it walks the global batches (replaying ``k`` of them to resume).
* ``OffLayout``: every slice of every global batch on every rank.
* ``FileLayout``: ``reader.batch(G)`` with files dealt round-robin; the rank's
  rows depend on the number of ranks.
* ``FunctionLayout``: ``distribute_datasets_from_function``'s per-rank datasets.

``resume_step`` maps a saved position to this width, or refuses (a
``ValueError`` naming the policy) where positions do not carry over.

    >>> from mpistrat.data.layouts import resume_step
    >>> resume_step("DATA", saved_step=7, saved_ranks=4, ranks=2)
    7
    >>> resume_step("OFF", saved_step=8, saved_ranks=4, ranks=2)
    4
"""

import itertools
from typing import Any, Iterator, List, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data import ops
from mpistrat.data.rebatch import rebatch_slices
from mpistrat.data.rows import Rows

__all__ = ["NO_LAYOUT", "DataLayout", "OffLayout", "FileLayout", "FunctionLayout",
           "read_ahead_steps", "resume_step", "step_groups"]

NO_LAYOUT = object()
GROUP_ROWS = 256      # rows a rank maps at once (several steps of a random-access pipeline)
GROUP_STEPS = 64
# records a rank reads ahead at once (sorted, coalesced runs): 8 MiB windows stay in cache
# while they are split and mapped (64 MiB made a TFRecord read 1.35x slower here)
READ_AHEAD_BYTES = 8 << 20
READ_AHEAD_STEPS = 1 << 14    # and at most this many steps: planning a window is per step


def resume_step(policy: str, saved_step: int, saved_ranks: int, ranks: int) -> int:
    """This width's step for a position saved at ``saved_ranks``, or ``ValueError``."""
    if saved_ranks == ranks or policy == "DATA":
        return saved_step                     # DATA: a step is a global batch at any width
    if policy == "OFF":
        if saved_step % saved_ranks == 0:     # at a global batch boundary
            return saved_step // saved_ranks * ranks
        raise ValueError(
            f"this iterator was saved at {saved_ranks} ranks under AutoShardPolicy.OFF in the "
            f"middle of global batch {saved_step // saved_ranks} (slice "
            f"{saved_step % saved_ranks}); at {ranks} ranks the slices differ: resume at "
            f"{saved_ranks} ranks, or save at a global batch boundary")
    what = {"FILE": "AutoShardPolicy.FILE (each rank reads whole files, so its rows depend "
                    "on the number of ranks)",
            "FUNCTION": "distribute_datasets_from_function (each rank's dataset is its own)"
            }.get(policy, policy)
    raise ValueError(f"this iterator was saved at {saved_ranks} ranks under {what}; it cannot "
                     f"resume exactly at {ranks} ranks: resume at {saved_ranks} ranks, or use "
                     f"AutoShardPolicy.DATA, whose positions carry over to any width")


def step_groups(start: int, length: Optional[int], limit: int = GROUP_STEPS):
    """Runs of consecutive steps from ``start``: 1 step first (a resumed iterator's first
    batch is ready at once, whatever the position), then ``limit`` steps at a time.

    >>> [list(r) for r in step_groups(3, 10, limit=4)]
    [[3], [4, 5, 6, 7], [8, 9]]
    """
    size, step = 1, start
    while length is None or step < length:
        stop = step + size if length is None else min(step + size, length)
        yield range(step, stop)
        step, size = stop, max(1, limit)


def read_ahead_steps(row_bytes: int, rows_per_step: int, group: int) -> int:
    """Steps a rank plans (and reads ahead) at once: ``group`` (the steps it maps at once)
    where it reads nothing (``row_bytes == 0``: rows in memory), else as many as fill
    ``READ_AHEAD_BYTES``, at most ``READ_AHEAD_STEPS``. Bounded in steps whatever the rows
    weigh, so that planning never runs to the end of a long or endless dataset.

    >>> read_ahead_steps(0, 2, 64), read_ahead_steps(4096, 8, 32), read_ahead_steps(1, 2, 64)
    (64, 256, 16384)
    """
    if row_bytes <= 0:
        return group
    return max(group, min(READ_AHEAD_STEPS, READ_AHEAD_BYTES // (row_bytes * rows_per_step)))


def _batch_of(rows: Rows) -> Any:
    if rows.count == 0 and not rows.is_stacked:
        return NO_LAYOUT
    return rows.stack()


class DataLayout:
    """DATA (and AUTO on anything but a reader with enough files)."""

    policy = "DATA"

    def __init__(self, node: ops.Node, ranks: int, rank: int):
        self.node, self.ranks, self.rank = node, ranks, rank
        self.random_access = node.blocker() is None
        self.row_bytes = sum(n.row_bytes for n in ops.walk(node) if isinstance(n, ops.Source))

    def local_steps(self, it: ops.Iteration, start: int) -> Iterator[Any]:
        if not self.random_access:
            return self._walk(it, start)
        return self._seek(self.node.plan(it), start)

    def _seek(self, plan, start):
        """Steps from ``start``: each window of steps is read ahead at once (its records,
        sorted and coalesced, within ``READ_AHEAD_BYTES`` and ``READ_AHEAD_STEPS``), then
        mapped in groups. Steps are planned one window at a time, never beyond it: an
        endless pipeline (``plan.length`` ``None``) costs per step what a finite one does."""
        if plan.length is not None and start >= plan.length:
            return
        if self.ranks == 1 and plan.batched:   # each step a whole batch: as plain iteration
            yield from ops.iterate_plan(plan, start)
            return
        rows_per_step = max(1, -(-plan.size(start) // self.ranks))
        group = max(1, min(GROUP_STEPS, GROUP_ROWS // rows_per_step))
        window = read_ahead_steps(self.row_bytes, rows_per_step, group)
        for steps in step_groups(start, plan.length, window):
            requests = [(step,) + rebatch_slices(plan.size(step), self.ranks)[self.rank]
                        for step in steps]
            if self.row_bytes:
                plan.need(requests)
            for first in range(0, len(requests), group):
                for rows in plan.rows(requests[first:first + group]):
                    yield _batch_of(rows)

    def _walk(self, it, start):
        for batch in itertools.islice(self.node.elements(it), start, None):
            a, b = rebatch_slices(_rows(batch), self.ranks)[self.rank]
            yield _slice(batch, a, b)


class OffLayout(DataLayout):
    """OFF: each rank steps through all N slices of every global batch."""

    policy = "OFF"

    def local_steps(self, it, start):
        first, skip = divmod(start, self.ranks)
        if self.random_access:
            plan = self.node.plan(it)
            batches = (plan.rows([(g, 0, plan.size(g))])[0].stack()
                       for g in (itertools.count(first) if plan.length is None
                                 else range(first, plan.length)))
        else:
            batches = itertools.islice(self.node.elements(it), first, None)
        steps = (_slice(batch, a, b) for batch in batches
                 for a, b in rebatch_slices(_rows(batch), self.ranks))
        return itertools.islice(steps, skip, None)


class FileLayout:
    """FILE: rank r reads files r, r + N, ... as one stream cut into ``ceil(G / N)`` rows."""

    policy = "FILE"
    random_access = True

    def __init__(self, reader, batch_size: int, drop_remainder: bool, ranks: int, rank: int):
        self.reader, self.drop = reader, drop_remainder
        self.mine = list(range(rank, len(reader.files), ranks))
        self.per_replica = -(-batch_size // ranks)

    def local_steps(self, it, start):
        counts = [self.reader.counts[f] for f in self.mine]
        total = sum(counts)
        steps = total // self.per_replica if self.drop else -(-total // self.per_replica)
        firsts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        for step in range(start, steps):
            lo, hi = step * self.per_replica, min((step + 1) * self.per_replica, total)
            parts = []
            for k, file_index in enumerate(self.mine):  # the files this batch spans
                a, b = max(lo, firsts[k]), min(hi, firsts[k + 1])
                if a < b:
                    parts.append(self.reader.read_file_rows(file_index, int(a - firsts[k]),
                                                            int(b - firsts[k])))
            yield parts[0] if len(parts) == 1 else np.concatenate(parts)


class FunctionLayout:
    """``distribute_datasets_from_function``: each local replica takes one element per step."""

    policy = "FUNCTION"

    def __init__(self, dataset, pieces: int):
        self.dataset, self.pieces = dataset, pieces
        self.random_access = False

    def local_steps(self, it, start):
        elements = self.dataset._node.elements(it)

        def groups():
            while True:
                group = tuple(itertools.islice(elements, self.pieces))
                if len(group) < self.pieces:
                    return
                yield group
        return itertools.islice(groups(), start, None)


def _rows(batch: Any) -> int:
    leaves = nest.flatten(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def _slice(batch: Any, start: int, stop: int) -> Any:
    return nest.map_structure(lambda leaf: np.asarray(leaf)[start:stop], batch)


def split_pieces(batch: Any, pieces: int) -> tuple:
    """One rank's batch cut into ``pieces`` equal per-replica components."""
    if pieces == 1:
        return (batch,)
    rows = _rows(batch) // pieces
    return tuple(_slice(batch, i * rows, (i + 1) * rows) for i in range(pieces))


def prefetch_depth(node: ops.Node) -> int:
    """The deepest ``prefetch`` in the pipeline (0 if none): how far a rank reads ahead."""
    return max([n.depth for n in ops.walk(node) if isinstance(n, ops.Prefetch)] or [0])


def file_reader_batch(node: ops.Node):
    """``(reader, batch node)`` when the pipeline is ``reader.batch(G)`` (prefetches aside)."""
    while isinstance(node, ops.Prefetch):
        node = node.input
    if isinstance(node, ops.Batch) and isinstance(node.input, ops.Source) and \
            getattr(node.input, "reader", None) is not None:
        return node.input.reader, node
    return None, None


def readers_in(node: ops.Node) -> List[Any]:
    """The file readers a pipeline reads (their views are agreed across ranks)."""
    return [n.reader for n in ops.walk(node) if getattr(n, "reader", None) is not None]
