"""Where the ranks of a communicator sit: their nodes and their GPUs.

Algorithms are chosen by topology, not by size alone: a flat ring that wins
on one host loses across hosts (docs/benchmarks.md), and NCCL refuses two
ranks on one GPU. ``Topology`` is a plain value built by a pure function, so
choices made from it are tested without MPI::

    >>> from mpistrat.collectives.topology import make_topology
    >>> t = make_topology(nodes=[7, 7, 9, 9], gpus=[None] * 4)
    >>> t.num_nodes, t.node_sizes, t.uniform, t.gpu_shared
    (2, (2, 2), True, False)
    >>> make_topology(nodes=[0, 1], gpus=["a", "a"]).gpu_shared_in_node
    False

``comm_topology(comm)`` measures it once per communicator (one small
all-gather, the first time it is asked) and caches it on the communicator
as an MPI attribute, so it is forgotten when the communicator is freed.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.deadline import Deadline, wait_all

__all__ = ["Topology", "make_topology", "comm_topology", "single_node"]


@dataclass(frozen=True)
class Topology:
    """Node of every rank (numbered 0.. in order of first appearance) and GPU sharing."""

    nodes: Tuple[int, ...]
    gpu_shared: bool = False          # two ranks of the communicator drive one physical GPU
    gpu_shared_in_node: bool = False  # ... and they are on the same (possibly simulated) node

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return max(self.nodes) + 1 if self.nodes else 0

    @property
    def node_sizes(self) -> Tuple[int, ...]:
        return tuple(self.nodes.count(n) for n in range(self.num_nodes))

    @property
    def uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        return len(set(self.node_sizes)) <= 1

    def describe(self) -> str:
        sizes = "+".join(str(s) for s in self.node_sizes)
        return f"{self.size} ranks on {self.num_nodes} node(s) ({sizes})"


def single_node(size: int) -> Topology:
    """The topology of ``size`` ranks on one node, no GPU shared."""
    return Topology((0,) * size)


def make_topology(nodes: Sequence, gpus: Sequence[Optional[object]]) -> Topology:
    """A ``Topology`` from each rank's node label and GPU key (``None``: no GPU)."""
    order: dict = {}
    numbered = tuple(order.setdefault(n, len(order)) for n in nodes)
    keys = [g for g in gpus if g is not None]
    in_node = [(n, g) for n, g in zip(numbered, gpus) if g is not None]
    return Topology(numbered, gpu_shared=len(keys) != len(set(keys)),
                    gpu_shared_in_node=len(in_node) != len(set(in_node)))


_KEYVAL = MPI.Comm.Create_keyval()


def comm_topology(comm: MPI.Comm, deadline: Optional[Deadline] = None) -> Topology:
    """The topology of ``comm`` (collective the first time for a communicator)."""
    size = comm.Get_size()
    if size == 1:
        return single_node(1)
    cached = comm.Get_attr(_KEYVAL)
    if cached is not None:
        return cached
    from mpistrat.runtime.gpus import bound_device
    from mpistrat.runtime.world import get_world
    world = get_world()
    bound = bound_device()
    gpu = bound.key if bound is not None and bound.key is not None else None
    mine = np.array([world.node_index, _stable_hash(gpu) if gpu is not None else -1], np.int64)
    table = np.empty((size, 2), np.int64)
    wait_all([comm.Iallgather(mine, table)], deadline, "topology")
    topology = make_topology(table[:, 0].tolist(),
                             [None if g == -1 else g for g in table[:, 1].tolist()])
    comm.Set_attr(_KEYVAL, topology)
    return topology


def _stable_hash(key) -> int:
    """A hash of a GPU key that is the same in every process (not Python's salted hash)."""
    import zlib
    return zlib.crc32(repr(key).encode())
