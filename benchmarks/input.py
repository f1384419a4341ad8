"""Input benchmark: aggregate read throughput of a distributed record dataset vs a raw read.

Run: scripts/mpirun -n N .venv/bin/python benchmarks/input.py [--gib 1.0] [--dir DIR]
Rank 0 writes the file once (kept between runs with --keep); the raw baseline is one process
reading the whole file sequentially with ``readinto``. The page cache is dropped before each
read when permitted (``cache`` says which). Reports bytes read per rank.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import drop_caches, emit  # noqa: E402

import mpistrat as ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--record-bytes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.path.join(args.dir, f"mpistrat-input-{int(args.gib * 1024)}MiB.bin")
    records = int(args.gib * (1 << 30)) // args.record_bytes
    if rank == 0 and (not os.path.exists(path) or os.path.getsize(path) != records * args.record_bytes):
        block = np.random.default_rng(0).integers(0, 255, size=(1 << 24), dtype=np.uint8)
        with open(path, "wb") as handle:
            for _ in range(records * args.record_bytes // block.size):
                handle.write(block)
            handle.write(block[:records * args.record_bytes % block.size])
    comm.Barrier()
    raw = None
    cache = "hot"
    if rank == 0:
        cache = "cold" if drop_caches() else "hot"
        buffer = bytearray(64 << 20)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
        raw = time.perf_counter() - start
        drop_caches()
    comm.Barrier()
    reader = ms.data.FixedLengthRecordDataset([path], args.record_bytes)
    strategy = ms.MultiWorkerMirroredStrategy()
    options = ms.data.Options()
    options.experimental_distribute.auto_shard_policy = ms.data.AutoShardPolicy.DATA
    dataset = reader.batch(args.batch * size).with_options(options)
    comm.Barrier()
    start = time.perf_counter()
    steps = sum(1 for _ in strategy.experimental_distribute_dataset(dataset))
    comm.Barrier()
    ours = time.perf_counter() - start
    per_rank = comm.gather(reader.bytes_read, root=0)
    total = records * args.record_bytes
    if rank == 0:
        emit(comm, {"benchmark": "input", "ranks": size, "gib": round(total / (1 << 30), 3),
                    "steps": steps, "ours_s": round(ours, 3), "raw_read_s": round(raw, 3),
                    "ours_gib_s": round(total / (1 << 30) / ours, 3),
                    "raw_gib_s": round(total / (1 << 30) / raw, 3),
                    "ratio": round(raw / ours, 3), "target": 0.8, "cache": cache,
                    "bytes_read_per_rank": per_rank})


if __name__ == "__main__":
    main()
