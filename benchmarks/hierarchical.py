"""Hierarchical vs flat ring vs raw ``MPI.Allreduce``, and what ``auto`` picks, same run.

The launcher comes from outside, so the same script runs on simulated nodes
here and on the real namespace cluster (issue 10)::

    MPISTRAT_RANKS_PER_NODE=2 scripts/mpirun -n 4 .venv/bin/python benchmarks/hierarchical.py
    LAUNCH="srun --mpi=pmix -N 2 -n 4"; $LAUNCH python benchmarks/hierarchical.py --iface eth0

Prints one JSON line per size (slowest rank, best of ``--repeats``) with the
ratio of each algorithm to raw ``MPI.Allreduce``. ``cross_node_bytes``: the
bytes each algorithm sends between nodes, from the algorithms' own message
pattern (a model, exact for ring and hierarchical); with ``--iface`` the
interface's tx counters are also read around each measurement and summed
over ranks (on real hosts; simulated nodes share one interface).
"""

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import best_seconds, emit  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.collectives.algorithms import allreduce  # noqa: E402
from mpistrat.collectives.backends import hierarchical  # noqa: E402
from mpistrat.collectives.backends.host import host_allreduce  # noqa: E402
from mpistrat.collectives.reduce_op import ReduceOp  # noqa: E402
from mpistrat.collectives.topology import comm_topology  # noqa: E402


def ring_cross_bytes(nbytes: int, nodes) -> int:
    """Bytes a flat ring sends across nodes: every hop carries 2 (n-1) chunks of nbytes/n;
    count the hops whose two ends are on different nodes."""
    n = len(nodes)
    hops = sum(1 for r in range(n) if nodes[r] != nodes[(r + 1) % n])
    return int(hops * 2 * (n - 1) * nbytes / n) if n > 1 else 0


def hierarchical_cross_bytes(nbytes: int, topology) -> int:
    """Bytes the cross-node step sends: the segments (nbytes in all) are each all-reduced
    among k = num_nodes owners, one per node; a bandwidth-optimal all-reduce sends
    2 (k-1)/k of the segment per owner, so 2 (k-1) nbytes in all."""
    return int(2 * (topology.num_nodes - 1) * nbytes)


def tx_bytes(iface):
    """Bytes sent by ``iface`` of this host's network namespace (``/proc/net/dev`` follows the
    reader's namespace, ``/sys/class/net`` does not)."""
    if not iface:
        return 0
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])
    return 0


def measured(comm, fn, repeats, iface):
    """Slowest rank's best time, and the bytes all hosts' links sent per call (read by one
    rank per host: the first of each node)."""
    leader = bool(iface) and MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank() == 0
    before = tx_bytes(iface) if leader else 0
    seconds = best_seconds(comm, fn, repeats)  # a warm-up call, then ``repeats`` calls
    sent = comm.allreduce(tx_bytes(iface) - before if leader else 0) if iface else None
    return seconds, (sent // (repeats + 1) if sent is not None else None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iface", default="", help="network interface whose tx bytes to read")
    args = parser.parse_args()
    strategy = ms.MultiWorkerMirroredStrategy()  # binds the device, builds the world
    comm = strategy.extended.engine.comm
    topology = comm_topology(comm)
    layout = "+".join(str(s) for s in topology.node_sizes)
    for mib in [int(x) for x in args.sizes_mib.split(",")]:
        count = (mib << 20) // 4
        send = np.full(count, 1.0 + comm.Get_rank(), np.float32)
        recv = np.empty_like(send)
        runs = {
            "raw_mpi": lambda: comm.Allreduce(send, recv, MPI.SUM),
            "ring": lambda: allreduce(comm, send, recv, ReduceOp.SUM, None, "ring"),
            "hierarchical": lambda: hierarchical.host_allreduce(comm, send, recv, ReduceOp.SUM,
                                                                None),
            "auto": lambda: host_allreduce(comm, send, recv, ReduceOp.SUM, None),
        }
        times, sent = {}, {}
        for name, fn in runs.items():
            times[name], sent[name] = measured(comm, fn, args.repeats, args.iface)
            assert recv[0] == sum(1.0 + r for r in range(comm.Get_size())), name
        chosen = host_allreduce(comm, send, recv, ReduceOp.SUM, None)
        record = {"benchmark": "hierarchical_allreduce", "ranks": comm.Get_size(),
                  "nodes": topology.num_nodes, "layout": layout, "mib": mib,
                  "auto_picks": chosen,
                  **{f"{k}_ms": round(v * 1e3, 2) for k, v in times.items()},
                  **{f"{k}_ratio": round(v / times["raw_mpi"], 3) for k, v in times.items()
                     if k != "raw_mpi"},
                  "cross_node_bytes_model": {
                      "ring": ring_cross_bytes(mib << 20, topology.nodes),
                      "hierarchical": hierarchical_cross_bytes(mib << 20, topology)}}
        if args.iface:
            record["tx_bytes_measured"] = sent
        emit(comm, record)


if __name__ == "__main__":
    main()
