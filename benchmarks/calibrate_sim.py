"""Measurements for the simulator's calibration and validation, on the namespace cluster.

One run on one layout and one link setting (benchmarks/calibrate_sim.sh runs every
layout, unshaped and shaped, and then fits and validates)::

    scripts/cluster up 4 2
    scripts/cluster mpirun --layout 2x2 .venv/bin/python benchmarks/calibrate_sim.py --link unshaped

Prints one JSON line per measurement (rank 0):

* ``pingpong``: rank 0 and a partner on another host (``pair: net``) and, when rank 1
  shares rank 0's host, with it (``pair: shm``): half the best round trip;
* ``combine``: rank 0 alone reduces two float32 buffers with NumPy (``np.add``), as
  our ring does, while the others wait;
* ``allreduce``: every engine algorithm through the host backend's own dispatch
  (``host_allreduce(..., preference=NAME)``; ``mpi`` is Open MPI's own), the slowest
  rank's best time over the repeats, for 1 KiB to 64 MiB of float32. The algorithms
  take turns in every repeat (the machine's other load falls on all alike), and small
  sizes are timed over 5 to 20 calls back to back (the ranks' skew leaving the
  barrier would otherwise add a message latency to every small measurement).
"""

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

import mpistrat as ms  # noqa: E402,F401  (starts the runtime: world, node split)
from mpistrat.collectives.backends.host import host_allreduce  # noqa: E402
from mpistrat.collectives.reduce_op import ReduceOp  # noqa: E402
from mpistrat.runtime import get_world  # noqa: E402
from mpistrat.simulate.programs import ENGINE_ALGORITHMS  # noqa: E402

SIZES = [1 << k for k in range(10, 27, 2)]   # 1 KiB .. 64 MiB


def repeats_for(nbytes: int, quick: bool) -> int:
    """Fewer repeats for the large sizes, so that a shaped run stays within minutes."""
    if quick:
        return 2
    return 7 if nbytes <= 1 << 20 else 5 if nbytes <= 16 << 20 else 3


def inner_for(nbytes: int) -> int:
    """Calls timed back to back: enough that the ranks' skew leaving the barrier is small."""
    return 20 if nbytes <= 64 << 10 else 5 if nbytes <= 1 << 20 else 1


def pingpong(comm, partner: int, nbytes: int, repeats: int) -> float:
    """Half the best round trip of ``nbytes`` between rank 0 and ``partner`` (others idle)."""
    rank = comm.Get_rank()
    buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]
    inner = inner_for(nbytes)
    best = float("inf")
    for _ in range(repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(inner):
            if rank == 0:
                comm.Send(buf, partner, 7)
                comm.Recv(buf, partner, 7)
            elif rank == partner:
                comm.Recv(buf, 0, 7)
                comm.Send(buf, 0, 7)
        best = min(best, (time.perf_counter() - start) / (2 * inner))
    return comm.bcast(best, root=0)


def interleaved(comm, calls, nbytes: int, repeats: int):
    """Best per-call time (slowest rank) of each of ``calls``, taking turns every repeat so that
    the machine's other load falls on all of them alike."""
    inner = inner_for(nbytes)
    best = [float("inf")] * len(calls)
    for call in calls:   # warm up
        call()
    for _ in range(repeats):
        for index, call in enumerate(calls):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(inner):
                call()
            elapsed = comm.allreduce((time.perf_counter() - start) / inner, op=MPI.MAX)
            best[index] = min(best[index], elapsed)
    return best


def combine_seconds(nbytes: int, repeats: int) -> float:
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    out = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        np.add(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--link", default="unshaped", help="label of the host links (1gbit)")
    parser.add_argument("--quick", action="store_true", help="2 repeats (for tests)")
    parser.add_argument("--max-mib", type=int, default=64)
    args = parser.parse_args()
    world = get_world()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [s for s in SIZES if s <= args.max_mib << 20]
    nodes = comm.allgather(world.node_index)
    layout = f"{world.num_nodes}x{max(nodes.count(n) for n in set(nodes))}"
    meta = {"layout": layout, "hosts": world.num_nodes, "ranks": size, "nodes": nodes,
            "link": args.link, "cores": len(os.sched_getaffinity(0)),
            "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    emit(comm, {"kind": "meta", **meta})
    # 1. ping-pong: to the first rank on another host, and to a rank on the same host
    partners = {}
    other = [r for r in range(size) if nodes[r] != nodes[0]]
    same = [r for r in range(1, size) if nodes[r] == nodes[0]]
    if other:
        partners["net"] = other[0]
    if same:
        partners["shm"] = same[0]
    for pair, partner in partners.items():
        for nbytes in sizes:
            seconds = pingpong(comm, partner, nbytes, repeats_for(nbytes, args.quick) * 2)
            emit(comm, {"kind": "pingpong", "pair": pair, "layout": layout, "link": args.link,
                        "bytes": nbytes, "seconds": seconds})
    # 2. NumPy's reduction rate on one rank (the others wait)
    for nbytes in sizes[-4:]:
        seconds = combine_seconds(nbytes, 5) if rank == 0 else 0.0
        seconds = comm.bcast(seconds, root=0)
        emit(comm, {"kind": "combine", "layout": layout, "bytes": nbytes, "seconds": seconds})
    # 3. every algorithm, every size, taking turns
    for nbytes in sizes:
        send = np.ones(nbytes // 4, np.float32)
        recvs = {a: np.zeros_like(send) for a in ENGINE_ALGORITHMS}   # checked afterwards
        used = {}

        def call_for(algorithm):
            def call():
                used[algorithm] = host_allreduce(comm, send, recvs[algorithm], ReduceOp.SUM,
                                                 None, preference=algorithm)
            return call

        times = interleaved(comm, [call_for(a) for a in ENGINE_ALGORITHMS], nbytes,
                            repeats_for(nbytes, args.quick))
        for algorithm, seconds in zip(ENGINE_ALGORITHMS, times):
            ok = bool(np.all(recvs[algorithm] == size))
            emit(comm, {"kind": "allreduce", "layout": layout, "link": args.link,
                        "algorithm": algorithm, "ran": used[algorithm], "bytes": nbytes,
                        "seconds": seconds, "correct": ok})
    sys.stdout.flush()
    if rank == 0:
        print(json.dumps({"kind": "done", "layout": layout, "link": args.link}), flush=True)


if __name__ == "__main__":
    main()
