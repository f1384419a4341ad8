"""What each of the engine's all-reduce algorithms does, for any layout: events and rounds.

Both come from the schedules the engine itself runs (``collectives/schedules.py``)
and, for the MPI library's own collectives, from our model of Open MPI
(``openmpi.py``):

* ``events(algorithm, count, nodes)``: per rank, the steps and library calls
  the engine plays, in the form ``algorithms.recording()`` records them from a
  real run (``tests/mpi/test_schedule_tie.py`` compares the two);
* ``rounds(algorithm, count, itemsize, nodes)``: the rounds the simulator plays.

``nodes`` gives the node of every rank (any labels; numbered in order of first
appearance, as ``collectives/topology.py`` does)::

    >>> [len(e) for e in events("ring", 10, [0, 0, 1])]
    [4, 4, 4]
    >>> events("hierarchical", 4, [0, 1])[0]
    [('call', 'allreduce', (0, 1), 4)]
    >>> len(rounds("rabenseifner", 1 << 20, 4, [0] * 8))
    6
"""

from typing import Dict, List, Sequence

from mpistrat.collectives.schedules import (hierarchical_phases, rabenseifner_steps,
                                            ring_all_gather_steps, ring_allreduce_steps,
                                            ring_reduce_scatter_steps, segments)
from mpistrat.collectives.topology import make_topology
from mpistrat.simulate import openmpi
from mpistrat.simulate.rounds import LIBRARY, Round, merge, relabel, zip_steps

__all__ = ["ENGINE_ALGORITHMS", "events", "rounds"]

# Every algorithm the engine can run for an all-reduce (``algorithms.ALGORITHMS`` less "auto").
ENGINE_ALGORITHMS = ("mpi", "ring", "hierarchical", "reduce_broadcast", "rabenseifner")
_FLAT_SCHEDULES = {"ring": ring_allreduce_steps, "rabenseifner": rabenseifner_steps}


def _members(nodes: Sequence) -> List[List[int]]:
    """The ranks of each node, in rank order."""
    numbered = make_topology(list(nodes), [None] * len(nodes)).nodes
    members: List[List[int]] = [[] for _ in range(max(numbered) + 1)]
    for rank, node in enumerate(numbered):
        members[node].append(rank)
    return members


def _step_events(steps, ranks: Sequence[int]) -> list:
    out = []
    for s in steps:
        send = None if s.send is None else (ranks[s.send[0]],) + s.send[1:]
        recv = None if s.recv is None else (ranks[s.recv[0]],) + s.recv[1:]
        out.append(("step", send, recv, s.combine))
    return out


def _check(algorithm: str) -> None:
    if algorithm not in ENGINE_ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; the engine runs "
                         f"{', '.join(ENGINE_ALGORITHMS)}")


def events(algorithm: str, count: int, nodes: Sequence) -> List[list]:
    """Per rank, what the engine plays for an all-reduce of ``count`` elements."""
    _check(algorithm)
    size = len(nodes)
    everyone = tuple(range(size))
    if algorithm == "mpi":
        return [[("call", "allreduce", everyone, count)] for _ in everyone]
    if algorithm == "reduce_broadcast":
        return [[("call", "reduce", everyone, count), ("call", "bcast", everyone, count)]
                for _ in everyone]
    if algorithm in _FLAT_SCHEDULES:
        if size == 1:
            return [[]]
        return [_step_events(_FLAT_SCHEDULES[algorithm](r, size, count), everyone)
                for r in everyone]
    members = _members(nodes)
    sizes = tuple(len(m) for m in members)
    out: List[list] = [[] for _ in everyone]
    for node, ranks in enumerate(members):
        for local, rank in enumerate(ranks):
            for phase in hierarchical_phases(count, sizes, node, local):
                if phase.kind == "cross":
                    owners = tuple(members[n][j] for n, j in enumerate(phase.segment.owners))
                    out[rank].append(("call", "allreduce", owners,
                                      phase.segment.stop - phase.segment.start))
                elif len(ranks) > 1:
                    steps = (ring_reduce_scatter_steps if phase.kind == "reduce_scatter"
                             else ring_all_gather_steps)(local, len(ranks), phase.bounds)
                    out[rank] += _step_events(steps, ranks)
    return out


def rounds(algorithm: str, count: int, itemsize: int, nodes: Sequence) -> List[Round]:
    """The rounds the simulator plays for one all-reduce of ``count`` items of ``itemsize``."""
    _check(algorithm)
    size = len(nodes)
    if algorithm == "mpi":
        return openmpi.allreduce_rounds(size, count, itemsize)
    if algorithm == "reduce_broadcast":
        return openmpi.reduce_rounds(size, count, itemsize) + \
            openmpi.bcast_rounds(size, count, itemsize)
    if algorithm in _FLAT_SCHEDULES:
        if size == 1:
            return []
        return zip_steps([_FLAT_SCHEDULES[algorithm](r, size, count) for r in range(size)],
                         itemsize)
    return _hierarchical_rounds(count, itemsize, _members(nodes))


def _node_rounds(kind: str, count: int, itemsize: int, members, sizes) -> List[Round]:
    """One in-node ring phase on every node at once."""
    steps_of = ring_reduce_scatter_steps if kind == "reduce_scatter" else ring_all_gather_steps
    per_node = []
    for node, ranks in enumerate(members):
        if len(ranks) > 1:
            bounds = hierarchical_phases(count, sizes, node, 0)[0].bounds
            per_node.append(zip_steps([steps_of(j, len(ranks), bounds) for j in range(len(ranks))],
                                      itemsize, ranks))
    return merge(per_node)


def _hierarchical_rounds(count: int, itemsize: int, members) -> List[Round]:
    sizes = tuple(len(m) for m in members)
    out = _node_rounds("reduce_scatter", count, itemsize, members, sizes)
    # cross-node all-reduces: a rank runs its segments in order, so a segment waits for the
    # earlier ones it shares an owner with; segments with disjoint owners run side by side
    waves: List[List[List[Round]]] = []
    last_wave: Dict[int, int] = {}
    for segment in segments(count, sizes):
        if segment.stop == segment.start:
            continue
        owners = [members[n][j] for n, j in enumerate(segment.owners)]
        wave = 1 + max((last_wave.get(o, -1) for o in owners), default=-1)
        for o in owners:
            last_wave[o] = wave
        if wave == len(waves):
            waves.append([])
        waves[wave].append(relabel(openmpi.allreduce_rounds(len(owners),
                                                            segment.stop - segment.start,
                                                            itemsize), owners))
    for groups in waves:
        out += [Round(r.transfers, r.combines, LIBRARY) for r in merge(groups)]
    return out + _node_rounds("all_gather", count, itemsize, members, sizes)
