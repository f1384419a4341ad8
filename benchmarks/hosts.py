"""Cross-host all-reduce: ours against raw ``MPI.Allreduce``, with the bytes that crossed
each host's link, counted by the kernel on the host's interface (``/proc/net/dev``).

Run on the namespace cluster (benchmarks/hosts.sh does it unshaped and shaped):

    scripts/cluster up 2 2
    scripts/cluster mpirun -n 4 .venv/bin/python benchmarks/hosts.py [--quick] [--link LABEL]

Prints one JSON line per size: the slowest rank's best time for each, ``ratio`` = ours /
raw, and per host the bytes sent and received on its link per call, as multiples of the
buffer (``tx_per_buffer``; ~1.5 at 2 hosts x 2 ranks for a ring over all ranks).
"""

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import best_seconds, emit  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.runtime import get_world  # noqa: E402


def link_bytes(interface: str):
    """(received, sent) bytes of ``interface`` in this process's network namespace."""
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                values = fields.split()
                return int(values[0]), int(values[8])
    raise RuntimeError(f"no interface {interface!r} in /proc/net/dev on {os.uname().nodename}")


def timed_with_bytes(comm, world, fn, repeats, interface):
    """Best time of ``fn`` and the bytes per call that crossed each host's link."""
    comm.Barrier()
    before = link_bytes(interface) if world.local_rank == 0 else (0, 0)
    seconds = best_seconds(comm, fn, repeats)        # repeats + 1 calls (one warm-up)
    comm.Barrier()
    after = link_bytes(interface) if world.local_rank == 0 else (0, 0)
    calls = repeats + 1
    mine = ((after[0] - before[0]) / calls, (after[1] - before[1]) / calls)
    per_host = [row for row, leader in zip(comm.allgather(mine),
                                           comm.allgather(world.local_rank == 0)) if leader]
    return seconds, per_host


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--link", default="unshaped", help="label for the links (e.g. 1gbit)")
    parser.add_argument("--interface", default="eth0", help="each host's link to the others")
    parser.add_argument("--sizes", default="1,16,64", help="MiB, comma separated")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    world = get_world()
    comm = MPI.COMM_WORLD.Dup()
    engine = ms.MultiWorkerMirroredStrategy().extended.engine
    for mib in [int(s) for s in args.sizes.split(",")]:
        buf = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
        out = np.empty_like(buf)
        raw, raw_bytes = timed_with_bytes(comm, world, lambda: comm.Allreduce(buf, out, MPI.SUM),
                                          repeats, args.interface)
        ours, our_bytes = timed_with_bytes(comm, world, lambda: engine.all_reduce(buf, "SUM"),
                                           repeats, args.interface)
        size = buf.nbytes
        emit(comm, {
            "benchmark": "allreduce_across_hosts", "hosts": world.num_nodes,
            "ranks_per_host": world.local_size, "link": args.link, "mib": mib,
            "ours_ms": round(ours * 1e3, 2), "raw_allreduce_ms": round(raw * 1e3, 2),
            "ratio": round(ours / raw, 3),
            "ours_tx_per_buffer": [round(tx / size, 3) for _, tx in our_bytes],
            "ours_rx_per_buffer": [round(rx / size, 3) for rx, _ in our_bytes],
            "raw_tx_per_buffer": [round(tx / size, 3) for _, tx in raw_bytes],
            "raw_rx_per_buffer": [round(rx / size, 3) for rx, _ in raw_bytes]})


if __name__ == "__main__":
    main()
