"""Profile the per-call cost of the small-tensor, scalar and ResNet-50 paths (cProfile).

Run: scripts/mpirun -n 2 .venv/bin/python benchmarks/profile_calls.py [--top 15]
Rank 0 prints the top functions by own time for each path.
"""

import argparse
import cProfile
import io
import os
import pstats
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from collectives import resnet50_shapes  # noqa: E402

import mpistrat as ms  # noqa: E402


def profile(comm, name, fn, calls, top):
    fn()
    comm.Barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if comm.Get_rank() == 0:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        print(f"==== {name}: {calls} calls")
        print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    profile(comm, "scalar strategy.reduce", lambda: strategy.reduce("SUM", 1.0, axis=None),
            5000, args.top)
    small = [np.full(256, float(i), dtype=np.float32) for i in range(2000)]
    profile(comm, "2000x256 strategy.reduce", lambda: strategy.reduce("SUM", small, axis=None),
            30, args.top)
    grads = [np.ones(s, np.float32) for s in resnet50_shapes()]
    profile(comm, "ResNet-50 strategy.reduce", lambda: strategy.reduce("SUM", grads, axis=None),
            10, args.top)


if __name__ == "__main__":
    main()
