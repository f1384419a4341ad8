"""Rounds: what every rank sends, receives and reduces at once, the unit the simulator plays.

A collective is a list of ``Round``; in a round each transfer moves
``nbytes`` from ``src`` to ``dst`` (ranks of the simulated communicator),
then every ``(rank, nbytes)`` of ``combines`` reduces that many received
bytes. A round ends when all of it is done: the simulator plays rounds one
after the other (a bulk-synchronous reading of the engine's steps, exact for
the symmetric schedules, where every rank waits for its neighbour anyway).

``zip_steps`` turns the per-rank step lists of ``collectives/schedules.py``
into rounds, checking that every send meets the matching receive::

    >>> from mpistrat.collectives.schedules import ring_allreduce_steps
    >>> rounds = zip_steps([ring_allreduce_steps(r, 2, 4) for r in range(2)], itemsize=4)
    >>> [(r.transfers, r.combines) for r in rounds]
    [(((0, 1, 8), (1, 0, 8)), ((0, 8), (1, 8))), (((0, 1, 8), (1, 0, 8)), ())]
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from mpistrat.collectives.schedules import PLACE, Step

__all__ = ["Round", "zip_steps", "relabel", "merge", "PYTHON", "LIBRARY"]

# Who runs a round's steps: our executor (a Python loop over Sendrecv) or the MPI library's
# own code; the platform gives each a per-round software overhead.
PYTHON, LIBRARY = "python", "mpi"


@dataclass(frozen=True)
class Round:
    """Transfers ``(src, dst, nbytes)`` and reductions ``(rank, nbytes)`` done together."""

    transfers: Tuple[Tuple[int, int, int], ...]
    combines: Tuple[Tuple[int, int], ...] = ()
    software: str = PYTHON

    def key(self) -> tuple:
        """A hashable description: rounds with equal keys take equal time on one platform."""
        return (tuple(sorted(self.transfers)), tuple(sorted(self.combines)), self.software)


def zip_steps(steps: Sequence[Sequence[Step]], itemsize: int,
              ranks: Optional[Sequence[int]] = None, software: str = PYTHON) -> List[Round]:
    """Round ``i`` = step ``i`` of every rank (``steps[r]`` is rank ``r``'s list).

    ``ranks`` relabels schedule ranks into communicator ranks (a schedule run
    on a sub-communicator). Raises ``ValueError`` when a send has no matching
    receive in the same round (a schedule that would deadlock or mismatch).
    """
    ranks = list(range(len(steps))) if ranks is None else list(ranks)
    length = max((len(s) for s in steps), default=0)
    if any(len(s) != length for s in steps):
        raise ValueError(f"schedules of unequal length: {[len(s) for s in steps]}")
    rounds = []
    for index, column in enumerate(zip(*steps)):
        sends, recvs, combines = [], [], []
        for rank, (send, recv, combine, _) in enumerate(column):
            if send is not None:
                sends.append((rank, send[0], send[2] - send[1]))
            if recv is not None:
                recvs.append((recv[0], rank, recv[2] - recv[1]))
                if combine != PLACE and recv[2] > recv[1]:
                    combines.append((ranks[rank], (recv[2] - recv[1]) * itemsize))
        sends.sort()
        recvs.sort()
        if sends != recvs:
            raise ValueError(f"round {index}: sends {sends} do not match receives {recvs}")
        if sends or combines:
            rounds.append(Round(tuple((ranks[a], ranks[b], n * itemsize) for a, b, n in sends),
                                tuple(combines), software))
    return rounds


def relabel(rounds: Sequence[Round], ranks: Sequence[int]) -> List[Round]:
    """The same rounds with schedule rank ``i`` renamed ``ranks[i]``."""
    return [Round(tuple((ranks[s], ranks[d], n) for s, d, n in r.transfers),
                  tuple((ranks[q], n) for q, n in r.combines), r.software) for r in rounds]


def merge(groups: Sequence[Sequence[Round]]) -> List[Round]:
    """Rounds of independent groups played side by side: round ``i`` of each together."""
    length = max((len(g) for g in groups), default=0)
    merged = []
    for index in range(length):
        parts = [g[index] for g in groups if index < len(g)]
        merged.append(Round(tuple(t for p in parts for t in p.transfers),
                            tuple(c for p in parts for c in p.combines),
                            parts[0].software if len({p.software for p in parts}) == 1
                            else PYTHON))
    return merged
