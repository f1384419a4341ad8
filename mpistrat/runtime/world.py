"""The library's private communicator and the node layout of the job.

mpistrat never communicates on ``MPI.COMM_WORLD`` itself: it takes its own
duplicate, so a user's mpi4py traffic cannot match the library's messages.
Ranks are grouped into nodes with ``Split_type(COMM_TYPE_SHARED)``; setting
``MPISTRAT_RANKS_PER_NODE=k`` instead groups consecutive ranks by ``k``, which
simulates a multi-node job on one machine::

    >>> from mpistrat.runtime import get_world
    >>> world = get_world()
    >>> world.rank, world.size, world.local_rank, world.num_nodes   # doctest: +SKIP
    (0, 1, 0, 1)
"""

import os
import socket
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

from mpi4py import MPI

from mpistrat.errors import UnavailableError
from mpistrat.runtime import health, launch_check, settings

__all__ = ["NodeLayout", "node_layout", "World", "get_world"]

RANKS_PER_NODE_ENV = "MPISTRAT_RANKS_PER_NODE"


@dataclass(frozen=True)
class NodeLayout:
    """Where one rank sits: its node and its place on that node."""

    node_index: int
    num_nodes: int
    local_rank: int
    local_size: int


def node_layout(rank: int, size: int, ranks_per_node: int) -> NodeLayout:
    """Layout of ``rank`` when consecutive ranks fill nodes of ``ranks_per_node``.

    A pure function: the last node may hold fewer ranks.

    >>> node_layout(4, 5, 2)
    NodeLayout(node_index=2, num_nodes=3, local_rank=0, local_size=1)
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a world of {size}")
    node_index = rank // ranks_per_node
    num_nodes = -(-size // ranks_per_node)
    first = node_index * ranks_per_node
    return NodeLayout(node_index, num_nodes, rank - first, min(ranks_per_node, size - first))


def _ranks_per_node_from_env() -> Optional[int]:
    return settings.get(RANKS_PER_NODE_ENV)


def _refuse_singletons(size: int) -> None:
    """Several processes launched, each a world of 1: raise (or warn for srun --mpi=none)."""
    refusal = launch_check.singleton_refusal(os.environ, size)
    if refusal is not None:
        raise UnavailableError(refusal)
    note = launch_check.unwired_srun_note(os.environ, size)
    if note is not None:
        warnings.warn(note, RuntimeWarning, stacklevel=3)


class World:
    """The job as mpistrat sees it: a private communicator and the node layout.

    ``comm`` is a duplicate of ``base`` (``COMM_WORLD`` by default);
    ``node_comm`` holds the ranks of this rank's node, ``leader_comm`` the
    first rank of every node (``MPI.COMM_NULL`` on the other ranks).
    ``set_by[name]``: the ranks of ``comm`` that set each per-rank variable
    (``settings.agree``), the same on every rank.
    """

    def __init__(self, base: Optional[MPI.Comm] = None, refuse_singletons: bool = True):
        base = MPI.COMM_WORLD if base is None else base
        self.comm = base.Dup()
        self.comm.Set_name("mpistrat")
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.hostname = socket.gethostname()
        if base == MPI.COMM_WORLD and refuse_singletons:
            _refuse_singletons(self.size)
        # every MPISTRAT_* variable of every rank: refused together; and which ranks set
        # each per-rank one (MPISTRAT_TIMELINE: a merged trace only when every rank asks)
        self.set_by = settings.agree(self.comm)
        per_node = _ranks_per_node_from_env()
        if per_node is None:
            self.node_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self.simulated_nodes = False
        else:
            color = node_layout(self.rank, self.size, per_node).node_index
            self.node_comm = self.comm.Split(color=color, key=self.rank)
            self.simulated_nodes = True
        self.local_rank = self.node_comm.Get_rank()
        self.local_size = self.node_comm.Get_size()
        is_leader = self.local_rank == 0
        self.leader_comm = self.comm.Split(0 if is_leader else MPI.UNDEFINED, key=self.rank)
        node_index = self.leader_comm.Get_rank() if is_leader else 0
        self.node_index = self.node_comm.bcast(node_index, root=0)
        self.num_nodes = self.comm.allreduce(1 if is_leader else 0)
        self.health = health.start(self.comm) if base == MPI.COMM_WORLD else None  # peers' end

    def new_comm(self, name: str) -> MPI.Comm:
        """A further duplicate of the private communicator (e.g. for a background thread).

        Collective: every rank must call it in the same order.
        """
        comm = self.comm.Dup()
        comm.Set_name(name)
        return comm

    def describe(self) -> str:
        """One line naming this rank and the layout, for logs and errors."""
        kind = "simulated " if self.simulated_nodes else ""
        return (f"rank {self.rank}/{self.size} on {self.hostname}, {kind}node "
                f"{self.node_index}/{self.num_nodes}, local rank {self.local_rank}/{self.local_size}")

    def __repr__(self) -> str:
        return f"<mpistrat.World {self.describe()}>"


_WORLD: Optional[World] = None
_WORLD_LOCK = threading.Lock()


def get_world(refuse_singletons: bool = True) -> World:
    """The process-wide :class:`World`, created on first use (collective).

    A process that the launcher started as one of several but that MPI sees alone raises
    ``UnavailableError`` (``launch_check``); ``refuse_singletons=False`` (the doctor, which
    reports it) lets the first call make that world anyway."""
    global _WORLD
    with _WORLD_LOCK:
        if _WORLD is None:
            _WORLD = World(refuse_singletons=refuse_singletons)
        return _WORLD
