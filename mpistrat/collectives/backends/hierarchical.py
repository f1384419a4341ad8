"""Hierarchical all-reduce: combine inside each node, then across nodes, then share.

The algorithm, one step per line (ChainerMN's shape)::

    1. reduce-scatter inside the node: each local rank gets the node's sum of its part;
    2. all-reduce across nodes: each part with the ranks owning it on the other nodes;
    3. all-gather inside the node: every rank gets every part.

Only ``1/local_size`` of the buffer per rank crosses host links, against
about twice the buffer for a flat ring. Steps 1 and 3 run on a *transport*:
our ring over shared memory for host buffers (``MPITransport``; Open MPI's
own ``Reduce_scatter`` ran several times slower here), NCCL for device
buffers (``backends/nccl.py``); step 2 always runs over MPI (staged through
host memory for device buffers).

Nodes of different sizes work too: the buffer is cut into ``L`` chunks
(``L`` = the largest node); a node of ``s`` ranks gives each rank a
contiguous run of chunks; each chunk is all-reduced across nodes among its
owners. The layout is pure::

    >>> from mpistrat.collectives.backends.hierarchical import node_parts, segments
    >>> node_parts(10, (2, 2), node=0)
    [(0, 5), (5, 10)]
    >>> [(s.start, s.stop, s.owners) for s in segments(10, (3, 1))]
    [(0, 4, (0, 0)), (4, 7, (1, 0)), (7, 10, (2, 0))]
    >>> [(s.start, s.stop, s.owners) for s in segments(9, (3, 2))]
    [(0, 3, (0, 0)), (3, 6, (1, 0)), (6, 9, (2, 1))]
"""

from typing import Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.algorithms import allreduce, ring_all_gather, ring_reduce_scatter
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.schedules import (Segment, chunk_owners, hierarchical_phases,
                                            node_parts, segments)
from mpistrat.collectives.topology import comm_topology

__all__ = ["Segment", "chunk_owners", "node_parts", "segments", "HierarchicalComms",
           "hierarchical_comms", "MPITransport", "run", "host_allreduce"]


class HierarchicalComms:
    """The communicators of the algorithm for one parent communicator."""

    def __init__(self, comm: MPI.Comm, deadline: Optional[Deadline], topology=None):
        topology = topology if topology is not None else comm_topology(comm, deadline)
        rank = comm.Get_rank()
        self.node = topology.nodes[rank]
        self.node_sizes = topology.node_sizes
        self.node_comm = comm.Split(color=self.node, key=rank)
        self.local_rank = self.node_comm.Get_rank()
        # one communicator per distinct owner pattern; every rank splits for each, in order
        self.cross: Dict[Tuple[int, ...], MPI.Comm] = {}
        for owners in dict.fromkeys(chunk_owners(self.node_sizes)):
            mine = owners[self.node] == self.local_rank
            sub = comm.Split(color=0 if mine else MPI.UNDEFINED, key=self.node)
            if mine:
                self.cross[owners] = sub


_KEYVAL = MPI.Comm.Create_keyval()


def hierarchical_comms(comm: MPI.Comm, deadline: Optional[Deadline] = None) -> HierarchicalComms:
    """The cached ``HierarchicalComms`` of ``comm`` (collective the first time)."""
    found = comm.Get_attr(_KEYVAL)
    if found is None:
        found = HierarchicalComms(comm, deadline)
        comm.Set_attr(_KEYVAL, found)
    return found


class MPITransport:
    """Steps 1 and 3 on host memory: our ring over the node's ranks (shared memory), step 2
    with MPI's own all-reduce (it suits the few ranks that cross hosts)."""

    def reduce_scatter(self, node_comm, send, recv, bounds, op: ReduceOp, deadline) -> None:
        ring_reduce_scatter(node_comm, send, recv, bounds, op, deadline)

    def cross_allreduce(self, cross_comm, piece, op: ReduceOp, deadline) -> None:
        allreduce(cross_comm, piece, piece, op, deadline, "mpi")

    def all_gather(self, node_comm, recv, bounds, deadline) -> None:
        ring_all_gather(node_comm, recv, bounds, deadline)


def run(comm: MPI.Comm, send, recv, op: ReduceOp, deadline: Optional[Deadline],
        transport, comms: Optional[HierarchicalComms] = None) -> None:
    """The three steps on flat buffers ``send`` and ``recv`` (``send`` may be ``recv``).

    ``comms`` defaults to the cached communicators of ``comm``'s real (or
    ``MPISTRAT_RANKS_PER_NODE``-simulated) topology.
    """
    comms = comms if comms is not None else hierarchical_comms(comm, deadline)
    # the phases are a pure function of the layout (schedules.py), shared with the simulator
    for phase in hierarchical_phases(send.size, comms.node_sizes, comms.node, comms.local_rank):
        if phase.kind == "reduce_scatter":
            # 1. reduce-scatter inside the node: recv[bounds[local_rank]] is the node's sum of it
            transport.reduce_scatter(comms.node_comm, send, recv, list(phase.bounds), op,
                                     deadline)
        elif phase.kind == "cross":
            # 2. all-reduce across nodes: a segment of this rank's part with its owners elsewhere
            segment = phase.segment
            transport.cross_allreduce(comms.cross[segment.owners],
                                      recv[segment.start:segment.stop], op, deadline)
        else:
            # 3. all-gather inside the node
            transport.all_gather(comms.node_comm, recv, list(phase.bounds), deadline)


_MPI = MPITransport()


def host_allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
                   deadline: Optional[Deadline], comms: Optional[HierarchicalComms] = None) -> None:
    """The hierarchical all-reduce of contiguous host buffers."""
    run(comm, send.reshape(-1), recv.reshape(-1), op, deadline, _MPI, comms)
