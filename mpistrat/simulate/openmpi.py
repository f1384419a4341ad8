"""Our model of Open MPI 4.1's own collectives: which algorithm its ``tuned`` component picks
by communicator size and message size, and the rounds of each algorithm.

The decision tables are our reading of ``coll_tuned_decision_fixed.c`` in Open MPI 4.1
(``ompi_coll_tuned_{allreduce,reduce,bcast}_intra_dec_fixed``, commutative operations),
restated as ``(size limit, [(bytes limit, algorithm), ...])`` rows: the first row whose limit
exceeds the communicator size applies, then the first entry whose byte limit exceeds the
message. Open MPI's fixed rules pass no segment size, so none of these algorithms segments
(its segmented ring falls back to the plain ring)::

    >>> allreduce_algorithm(4, 64 << 20), allreduce_algorithm(2, 1024)
    ('rabenseifner', 'recursive_doubling')
    >>> reduce_algorithm(4, 1 << 30), bcast_algorithm(4, 1 << 30)
    ('linear', 'chain')

The rounds of the allreduce algorithms that Open MPI and our engine share (ring,
recursive doubling, recursive halving-doubling) come from ``collectives/schedules.py``;
the trees (linear, chain, binary, binomial, k-nomial, scatter-allgather) are modelled
here, with the shape of Open MPI's trees (binomial: every parent sends to all its
children at once; reduction trees the same way up). Rank 0 is the root.
"""

from typing import List

from mpistrat.collectives.schedules import (rabenseifner_steps, recursive_doubling_steps,
                                            ring_allreduce_steps)
from mpistrat.partition import even_ranges
from mpistrat.simulate.rounds import LIBRARY, Round, zip_steps

__all__ = ["allreduce_algorithm", "reduce_algorithm", "bcast_algorithm", "allreduce_rounds",
           "reduce_rounds", "bcast_rounds"]

_BIG = 1 << 62
_ALLREDUCE = {1: "linear", 2: "nonoverlapping", 3: "recursive_doubling", 4: "ring",
              5: "ring", 6: "rabenseifner"}
_ALLREDUCE_RULES = [
    (4, [(8, 4), (4096, 3), (8192, 4), (16384, 3), (65536, 4), (262144, 5), (_BIG, 6)]),
    (8, [(16, 4), (8192, 3), (_BIG, 6)]),
    (16, [(8192, 3), (_BIG, 6)]),
    (32, [(64, 5), (4096, 3), (_BIG, 6)]),
    (64, [(128, 5), (_BIG, 6)]),
    (128, [(262144, 3), (_BIG, 6)]),
    (256, [(131072, 2), (262144, 3), (_BIG, 6)]),
    (512, [(4096, 2), (_BIG, 6)]),
    (2048, [(2048, 2), (16384, 3), (_BIG, 6)]),
    (4096, [(2048, 2), (4096, 5), (16384, 3), (_BIG, 6)]),
    (_BIG, [(2048, 2), (16384, 5), (32768, 3), (_BIG, 6)]),
]
_REDUCE = {1: "linear", 2: "chain", 3: "pipeline", 4: "binary", 5: "binomial",
           6: "in_order_binary", 7: "rabenseifner"}
_REDUCE_RULES = [
    (4, [(8, 7), (16, 4), (32, 3), (262144, 1), (524288, 3), (1048576, 2), (_BIG, 3)]),
    (8, [(4096, 4), (65536, 2), (262144, 5), (524288, 1), (1048576, 5), (_BIG, 1)]),
    (16, [(8192, 4), (_BIG, 5)]),
    (32, [(4096, 4), (_BIG, 5)]),
    (256, [(_BIG, 5)]),
    (512, [(8192, 5), (16384, 6), (_BIG, 5)]),
    (2048, [(_BIG, 5)]),
    (4096, [(512, 5), (1024, 6), (8192, 5), (16384, 6), (_BIG, 5)]),
    (_BIG, [(16, 5), (32, 6), (1024, 5), (2048, 6), (8192, 5), (16384, 6), (_BIG, 5)]),
]
_BCAST = {1: "linear", 2: "chain", 3: "pipeline", 4: "split_binary_tree", 5: "binary_tree",
          6: "binomial", 7: "knomial", 8: "scatter_allgather", 9: "scatter_allgather_ring"}
_BCAST_RULES = [
    (4, [(32, 3), (256, 5), (512, 3), (1024, 7), (32768, 1), (131072, 5), (262144, 2),
         (524288, 1), (1048576, 6), (_BIG, 5)]),
    (8, [(64, 5), (128, 6), (2048, 5), (8192, 6), (1048576, 1), (_BIG, 2)]),
    (16, [(8, 7), (64, 5), (4096, 7), (16384, 5), (32768, 6), (_BIG, 1)]),
    (32, [(4096, 7), (1048576, 6), (_BIG, 8)]),
    (64, [(2048, 6), (_BIG, 7)]),
    (128, [(_BIG, 7)]),
    (256, [(2, 6), (16384, 5), (32768, 1), (65536, 5), (_BIG, 7)]),
    (1024, [(16384, 7), (32768, 4), (_BIG, 7)]),
    (2048, [(524288, 7), (_BIG, 8)]),
    (4096, [(262144, 7), (_BIG, 8)]),
    (_BIG, [(8192, 7), (16384, 5), (262144, 7), (_BIG, 8)]),
]


def _pick(rules, names, size: int, nbytes: int) -> str:
    for size_limit, row in rules:
        if size < size_limit:
            for bytes_limit, algorithm in row:
                if nbytes < bytes_limit:
                    return names[algorithm]
    raise AssertionError("unreachable: the last rows have no limit")


def allreduce_algorithm(size: int, nbytes: int) -> str:
    """The algorithm Open MPI 4.1's tuned ``MPI_Allreduce`` runs (commutative op)."""
    return _pick(_ALLREDUCE_RULES, _ALLREDUCE, size, nbytes)


def reduce_algorithm(size: int, nbytes: int) -> str:
    """The algorithm Open MPI 4.1's tuned ``MPI_Reduce`` runs (commutative op)."""
    return _pick(_REDUCE_RULES, _REDUCE, size, nbytes)


def bcast_algorithm(size: int, nbytes: int) -> str:
    """The algorithm Open MPI 4.1's tuned ``MPI_Bcast`` runs."""
    return _pick(_BCAST_RULES, _BCAST, size, nbytes)


# --- trees: (parent, children) per rank, root 0 ---

def _tree(kind: str, size: int) -> List[List[int]]:
    """Children of every rank in Open MPI's tree of that kind (rank 0 the root)."""
    children: List[List[int]] = [[] for _ in range(size)]
    for rank in range(1, size):
        if kind in ("binary_tree", "split_binary_tree", "binary", "in_order_binary"):
            parent = (rank - 1) // 2
        elif kind == "binomial":
            parent = rank & (rank - 1)          # lowest set bit cleared
        elif kind == "knomial":                 # radix 4 (coll_tuned_bcast_knomial_radix)
            mask = 1
            while rank % (4 * mask) == 0:
                mask *= 4
            parent = rank - (rank % (4 * mask))
        elif kind in ("chain", "pipeline"):     # no fan-out given: one chain
            parent = rank - 1
        else:                                   # linear
            parent = 0
        children[parent].append(rank)
    return children


def _depths(children: List[List[int]]) -> List[int]:
    depth = [0] * len(children)
    for parent, kids in enumerate(children):   # parents precede children in rank order
        for child in kids:
            depth[child] = depth[parent] + 1
    return depth


def _down_tree(kind: str, size: int, nbytes: int) -> List[Round]:
    """A broadcast down a tree: every parent sends to all its children at once, level by level."""
    children = _tree(kind, size)
    depth = _depths(children)
    rounds = []
    for level in range(max(depth, default=0)):
        transfers = tuple((p, c, nbytes) for p in range(size) if depth[p] == level
                          for c in children[p])
        rounds.append(Round(transfers, (), LIBRARY))
    return rounds


def _up_tree(kind: str, size: int, nbytes: int) -> List[Round]:
    """A reduction up a tree: the deepest level first; each parent combines what it received."""
    children = _tree(kind, size)
    depth = _depths(children)
    parent = {c: p for p, kids in enumerate(children) for c in kids}
    rounds = []
    for level in range(max(depth, default=0), 0, -1):
        movers = [c for c in range(size) if depth[c] == level]
        rounds.append(Round(tuple((c, parent[c], nbytes) for c in movers),
                            tuple((parent[c], nbytes) for c in movers), LIBRARY))
    return rounds


def _linear_reduce(size: int, nbytes: int) -> List[Round]:
    """The root receives from each rank in turn (rendezvous serialises them) and combines."""
    return [Round(((src, 0, nbytes),), ((0, nbytes),), LIBRARY) for src in range(size - 1, 0, -1)]


def _chain_up(size: int, nbytes: int) -> List[Round]:
    """One unsegmented chain: the last rank's data travels to the root, combined on the way."""
    return [Round(((r, r - 1, nbytes),), ((r - 1, nbytes),), LIBRARY)
            for r in range(size - 1, 0, -1)]


def _chain_down(size: int, nbytes: int) -> List[Round]:
    return [Round(((r, r + 1, nbytes),), (), LIBRARY) for r in range(size - 1)]


def _scatter_allgather(size: int, count: int, itemsize: int, ring: bool) -> List[Round]:
    """Binomial scatter of the blocks from the root, then an all-gather of the blocks
    (recursive doubling on a power of two, else a ring)."""
    blocks = even_ranges(count, size)
    rounds = []
    mask = 1 << max(size - 1, 0).bit_length()
    while mask > 1:
        mask >>= 1
        transfers = []
        for rank in range(0, size, 2 * mask):
            if rank + mask < size:
                lo, hi = rank + mask, min(rank + 2 * mask, size)
                nbytes = (blocks[hi - 1][1] - blocks[lo][0]) * itemsize
                transfers.append((rank, rank + mask, nbytes))
        if transfers:
            rounds.append(Round(tuple(transfers), (), LIBRARY))
    if ring or size & (size - 1):
        for step in range(size - 1):
            rounds.append(Round(tuple((r, (r + 1) % size,
                                       (blocks[(r - step) % size][1] - blocks[(r - step) % size][0])
                                       * itemsize) for r in range(size)), (), LIBRARY))
    else:
        width = 1
        while width < size:
            rounds.append(Round(tuple((r, r ^ width, _span(blocks, r, width) * itemsize)
                                      for r in range(size)), (), LIBRARY))
            width *= 2
    return rounds


def _span(blocks, rank: int, width: int) -> int:
    lo = rank - rank % width
    return blocks[lo + width - 1][1] - blocks[lo][0]


def bcast_rounds(size: int, count: int, itemsize: int) -> List[Round]:
    """The rounds of Open MPI's ``MPI_Bcast`` from rank 0 over ``size`` ranks."""
    if size == 1:
        return []
    nbytes = count * itemsize
    algorithm = bcast_algorithm(size, nbytes)
    if algorithm in ("chain", "pipeline"):
        return _chain_down(size, nbytes)
    if algorithm in ("scatter_allgather", "scatter_allgather_ring"):
        return _scatter_allgather(size, count, itemsize, algorithm.endswith("ring"))
    return _down_tree(algorithm, size, nbytes)


def reduce_rounds(size: int, count: int, itemsize: int) -> List[Round]:
    """The rounds of Open MPI's ``MPI_Reduce`` to rank 0 over ``size`` ranks."""
    if size == 1:
        return []
    nbytes = count * itemsize
    algorithm = reduce_algorithm(size, nbytes)
    if algorithm == "linear":
        return _linear_reduce(size, nbytes)
    if algorithm in ("chain", "pipeline"):
        return _chain_up(size, nbytes)
    if algorithm == "rabenseifner":   # only below 8 bytes: as small as a binomial tree
        algorithm = "binomial"
    return _up_tree(algorithm, size, nbytes)


def allreduce_rounds(size: int, count: int, itemsize: int) -> List[Round]:
    """The rounds of Open MPI's ``MPI_Allreduce`` over ``size`` ranks."""
    if size == 1:
        return []
    algorithm = allreduce_algorithm(size, count * itemsize)
    if algorithm == "linear":
        return _linear_reduce(size, count * itemsize) + _down_tree("linear", size,
                                                                   count * itemsize)
    if algorithm == "nonoverlapping":
        return reduce_rounds(size, count, itemsize) + bcast_rounds(size, count, itemsize)
    schedule = {"recursive_doubling": recursive_doubling_steps, "ring": ring_allreduce_steps,
                "rabenseifner": rabenseifner_steps}[algorithm]
    return zip_steps([schedule(r, size, count) for r in range(size)], itemsize,
                     software=LIBRARY)


def describe(kind: str, size: int, nbytes: int) -> str:
    """The name of Open MPI's algorithm for a collective (``allreduce``, ``reduce``, ``bcast``)."""
    pick = {"allreduce": allreduce_algorithm, "reduce": reduce_algorithm,
            "bcast": bcast_algorithm}[kind]
    return pick(size, nbytes) if size > 1 else "none (one rank)"
