"""Schedules: the send/receive steps of our all-reduce algorithms, as pure functions.

One function per algorithm gives, for one rank, the list of ``Step`` it takes.
The engine plays these steps over MPI (``algorithms.play``) and the simulator
(``mpistrat/simulate``) plays the very same steps on a simulated platform, so
a change here changes both. A step sends at most one range of the flat buffer
and receives at most one; what it does with what it received is ``combine``:

* ``FRESH``: ``out[r] = input[r] (+) received`` (the first touch of ``r``);
* ``ACCUMULATE``: ``out[r] = out[r] (+) received``;
* ``PLACE``: the received elements land in ``out[r]`` as they are.

``source`` says where the sent elements are read: ``INPUT`` (the caller's
buffer, never written) or ``OUTPUT``. Every rank of a schedule has the same
number of steps; a rank with nothing to do in a round has an idle step, so
step ``i`` of every rank is one round::

    >>> from mpistrat.collectives.schedules import ring_allreduce_steps
    >>> [(s.send, s.recv, s.combine) for s in ring_allreduce_steps(0, 3, 6)][:2]
    [((1, 4, 6), (2, 2, 4), 'fresh'), ((1, 2, 4), (2, 0, 2), 'fresh')]

(``send`` and ``recv`` are ``(peer, start, stop)``.)

Algorithms here:

* ring reduce-scatter and all-gather on any partition (``ring_reduce_scatter_steps``,
  ``ring_all_gather_steps``): ``2 (n-1)`` steps, each ``1/n`` of the buffer;
* ``rabenseifner_steps``: reduce-scatter by recursive halving, all-gather by
  recursive doubling: ``2 log2 p`` steps (``p`` the largest power of two
  ``<= n``; the ``n - p`` extra ranks first hand their data to a partner and
  get the result back at the end), the same bytes as the ring;
* ``recursive_doubling_steps``: the whole buffer exchanged ``log2 p`` times
  (latency-optimal, for small buffers);
* the hierarchical algorithm's layout (``node_parts``, ``segments``) and its
  three phases (``hierarchical_phases``).
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

from mpistrat.partition import even_ranges

__all__ = ["Step", "INPUT", "OUTPUT", "FRESH", "ACCUMULATE", "PLACE",
           "ring_reduce_scatter_steps", "ring_all_gather_steps", "ring_allreduce_steps",
           "rabenseifner_steps", "recursive_doubling_steps", "power_of_two_fold",
           "Segment", "chunk_owners", "node_parts", "segments", "Phase", "hierarchical_phases"]

INPUT, OUTPUT = "input", "output"
FRESH, ACCUMULATE, PLACE = "fresh", "accumulate", "place"

Range = Tuple[int, int, int]  # (peer, start, stop)


class Step(NamedTuple):
    """One round of one rank: send ``send`` (or nothing), receive ``recv`` (or nothing).

    (A named tuple, not a dataclass: a simulation of 1,024 ranks makes millions.)
    """

    send: Optional[Range] = None
    recv: Optional[Range] = None
    combine: str = PLACE
    source: str = OUTPUT

    @property
    def idle(self) -> bool:
        return self.send is None and self.recv is None


IDLE = Step()


def ring_reduce_scatter_steps(rank: int, size: int, bounds: Sequence[Tuple[int, int]]) -> List[Step]:
    """Ring reduce-scatter: afterwards ``out[bounds[rank]]`` is complete on ``rank``.

    Partial sums pass to the right: at step ``k`` rank ``r`` sends chunk
    ``r-k-1`` and combines chunk ``r-k-2`` arriving from the left.
    """
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for step in range(size - 1):
        a, b = bounds[(rank - step - 1) % size]
        c, d = bounds[(rank - step - 2) % size]
        steps.append(Step((right, a, b), (left, c, d), FRESH, INPUT if step == 0 else OUTPUT))
    return steps


def ring_all_gather_steps(rank: int, size: int, bounds: Sequence[Tuple[int, int]]) -> List[Step]:
    """Ring all-gather: rank ``r`` contributes ``out[bounds[r]]``; complete chunks pass right."""
    right, left = (rank + 1) % size, (rank - 1) % size
    steps = []
    for step in range(size - 1):
        a, b = bounds[(rank - step) % size]
        c, d = bounds[(rank - step - 1) % size]
        steps.append(Step((right, a, b), (left, c, d), PLACE, OUTPUT))
    return steps


def ring_allreduce_steps(rank: int, size: int, count: int) -> List[Step]:
    """The ring all-reduce of ``count`` elements: reduce-scatter, then all-gather."""
    bounds = even_ranges(count, size)
    return ring_reduce_scatter_steps(rank, size, bounds) + ring_all_gather_steps(rank, size, bounds)


def power_of_two_fold(rank: int, size: int) -> Tuple[int, int]:
    """``(p, new_rank)``: the ``p = 2**floor(log2 size)`` ranks that run the power-of-two
    part, and this rank's index among them (``-1``: it hands its data to ``rank - 1``).

    The first ``2 (size - p)`` ranks pair up; the odd one of each pair sits out.

    >>> [power_of_two_fold(r, 6)[1] for r in range(6)]
    [0, -1, 1, -1, 2, 3]
    """
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    if rank < 2 * extra:
        return p, (rank // 2 if rank % 2 == 0 else -1)
    return p, rank - extra


def _old_rank(new_rank: int, size: int) -> int:
    extra = size - (1 << (size.bit_length() - 1))
    return new_rank * 2 if new_rank < extra else new_rank + extra


def _fold_in(rank: int, size: int, count: int) -> Step:
    """The first round: the odd rank of each extra pair sends everything to its partner."""
    p, new = power_of_two_fold(rank, size)
    if rank >= 2 * (size - p):
        return IDLE
    if new < 0:
        return Step(send=(rank - 1, 0, count), source=INPUT)
    return Step(recv=(rank + 1, 0, count), combine=FRESH)


def _fold_out(rank: int, size: int, count: int) -> Step:
    """The last round: the partner sends the complete result back."""
    p, new = power_of_two_fold(rank, size)
    if rank >= 2 * (size - p):
        return IDLE
    if new < 0:
        return Step(recv=(rank - 1, 0, count), combine=PLACE)
    return Step(send=(rank + 1, 0, count))


def rabenseifner_steps(rank: int, size: int, count: int) -> List[Step]:
    """Recursive halving reduce-scatter, then recursive doubling all-gather.

    The power-of-two ranks first exchange halves with the rank ``1`` away,
    then quarters with the rank ``2`` away, and so on (neighbours first, so on
    nodes of consecutive ranks the large halves stay inside the node); the
    all-gather retraces the steps. ``2 log2 p`` rounds (plus one before and
    one after when ``size`` is not a power of two).
    """
    if size == 1:
        return []
    p, new = power_of_two_fold(rank, size)
    folded = size != p
    touched = rank < 2 * (size - p)  # out already holds this rank's partner's sum
    blocks = even_ranges(count, p)
    levels = p.bit_length() - 1
    steps = [_fold_in(rank, size, count)] if folded else []
    if new < 0:
        steps += [IDLE] * (2 * levels)
    else:
        lo, hi, windows = 0, p, []
        for level in range(levels):  # reduce-scatter: keep one half of the window
            mask = 1 << level
            partner = _old_rank(new ^ mask, size)
            half = (hi - lo) // 2
            keep, give = ((lo, lo + half), (lo + half, hi)) if new & mask == 0 else \
                ((lo + half, hi), (lo, lo + half))
            first = level == 0 and not touched
            steps.append(Step((partner, blocks[give[0]][0], blocks[give[1] - 1][1]),
                              (partner, blocks[keep[0]][0], blocks[keep[1] - 1][1]),
                              FRESH if first else ACCUMULATE, INPUT if first else OUTPUT))
            windows.append((partner, keep, give))
            lo, hi = keep
        for partner, keep, give in reversed(windows):  # all-gather: swap the kept halves back
            steps.append(Step((partner, blocks[keep[0]][0], blocks[keep[1] - 1][1]),
                              (partner, blocks[give[0]][0], blocks[give[1] - 1][1]), PLACE))
    if folded:
        steps.append(_fold_out(rank, size, count))
    return steps


def recursive_doubling_steps(rank: int, size: int, count: int) -> List[Step]:
    """The whole buffer exchanged with the rank ``1, 2, 4, ...`` away (``log2 p`` rounds)."""
    if size == 1:
        return []
    p, new = power_of_two_fold(rank, size)
    folded = size != p
    touched = rank < 2 * (size - p)
    levels = p.bit_length() - 1
    steps = [_fold_in(rank, size, count)] if folded else []
    if new < 0:
        steps += [IDLE] * levels
    else:
        for level in range(levels):
            partner = _old_rank(new ^ (1 << level), size)
            first = level == 0 and not touched
            steps.append(Step((partner, 0, count), (partner, 0, count),
                              FRESH if first else ACCUMULATE, INPUT if first else OUTPUT))
    if folded:
        steps.append(_fold_out(rank, size, count))
    return steps


# --- the hierarchical algorithm's layout (backends/hierarchical.py runs it) ---

@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)``, all-reduced across nodes among ``owners[n]`` of each node."""

    start: int
    stop: int
    owners: Tuple[int, ...]


def chunk_owners(node_sizes: Sequence[int]) -> List[Tuple[int, ...]]:
    """For each of the ``L = max(node_sizes)`` chunks, its owning local rank on every node."""
    chunks = max(node_sizes)
    owners = []
    for chunk in range(chunks):
        row = []
        for size in node_sizes:
            runs = even_ranges(chunks, size)  # local rank j owns chunks [a, b) of runs[j]
            row.append(next(j for j, (a, b) in enumerate(runs) if a <= chunk < b))
        owners.append(tuple(row))
    return owners


def node_parts(count: int, node_sizes: Sequence[int], node: int) -> List[Tuple[int, int]]:
    """The element range each local rank of ``node`` owns after the node's reduce-scatter."""
    chunks = even_ranges(count, max(node_sizes))
    return [(chunks[a][0], chunks[b - 1][1]) for a, b in
            even_ranges(len(chunks), node_sizes[node])]


def segments(count: int, node_sizes: Sequence[int]) -> List[Segment]:
    """Consecutive chunks with the same owners merged: one cross-node all-reduce each."""
    merged: List[Segment] = []
    for (start, stop), owners in zip(even_ranges(count, max(node_sizes)),
                                     chunk_owners(node_sizes)):
        if merged and merged[-1].owners == owners:
            merged[-1] = Segment(merged[-1].start, stop, owners)
        else:
            merged.append(Segment(start, stop, owners))
    return merged


@dataclass(frozen=True)
class Phase:
    """One phase of the hierarchical algorithm for one rank.

    ``kind`` is ``"reduce_scatter"`` or ``"all_gather"`` (inside the node, on
    ``bounds``, one range per local rank) or ``"cross"`` (``segment`` all-reduced
    with its owners on the other nodes).
    """

    kind: str
    bounds: Tuple[Tuple[int, int], ...] = ()
    segment: Optional[Segment] = None


def hierarchical_phases(count: int, node_sizes: Sequence[int], node: int,
                        local_rank: int) -> List[Phase]:
    """The phases one rank runs: reduce-scatter in its node, one cross-node all-reduce per
    segment it owns (empty ones skipped), all-gather in its node.

    >>> [p.kind for p in hierarchical_phases(10, (2, 2), 0, 1)]
    ['reduce_scatter', 'cross', 'all_gather']
    """
    bounds = tuple(node_parts(count, node_sizes, node))
    cross = [Phase("cross", segment=s) for s in segments(count, node_sizes)
             if s.owners[node] == local_rank and s.stop > s.start]
    return [Phase("reduce_scatter", bounds)] + cross + [Phase("all_gather", bounds)]
