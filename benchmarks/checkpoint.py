"""Checkpoint benchmark: save and restore a state of 64 float32 tensors against raw file I/O.

Run: scripts/mpirun -n N .venv/bin/python benchmarks/checkpoint.py [--gib 1.0] [--dir DIR]
Raw baselines (same run, rank 0 alone): numpy.tofile + fsync of the same bytes, and
numpy.fromfile of them. Reads are hot-cache reads unless the page cache could be dropped
(``cache`` in the output says which).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import drop_caches, emit  # noqa: E402

import mpistrat as ms  # noqa: E402


def timed(comm, fn) -> float:
    comm.Barrier()
    start = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    base = comm.bcast(tempfile.mkdtemp(dir=args.dir) if rank == 0 else None)
    per_tensor = int(args.gib * (1 << 30)) // 64 // 4
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        tensors = {f"t{i:02d}": ms.Variable(np.full(per_tensor, i, dtype=np.float32))
                   for i in range(64)}
    nbytes = 64 * per_tensor * 4
    ckpt = ms.Checkpoint(model=tensors)

    raw_write = raw_read = float("inf")
    ours_save = ours_restore = async_block = async_total = float("inf")
    cache = "hot"
    for _ in range(args.repeats):
        if rank == 0:  # raw baselines, one process, the same bytes
            blob = np.concatenate([v.numpy() for v in tensors.values()])
            path = os.path.join(base, "raw.bin")
            start = time.perf_counter()
            with open(path, "wb") as handle:
                blob.tofile(handle)
                handle.flush()
                os.fsync(handle.fileno())
            raw_write = min(raw_write, time.perf_counter() - start)
            del blob
            cache = "cold" if drop_caches() else "hot"
            start = time.perf_counter()
            np.fromfile(path, dtype=np.float32)
            raw_read = min(raw_read, time.perf_counter() - start)
            os.remove(path)
        comm.Barrier()
        prefix = os.path.join(base, "ckpt")
        ours_save = min(ours_save, timed(comm, lambda: ckpt.save(prefix)))
        latest = ms.latest_checkpoint(base)
        if rank == 0:
            drop_caches()
        ours_restore = min(ours_restore, timed(comm, lambda: ckpt.restore(latest)))
        comm.Barrier()
        start = time.perf_counter()
        ckpt.save(prefix, options=ms.CheckpointOptions(enable_async=True))
        blocked = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        ckpt.sync()
        comm.Barrier()
        async_block = min(async_block, blocked)
        async_total = min(async_total, time.perf_counter() - start)
        if rank == 0:
            for name in os.listdir(base):
                if name.startswith("ckpt-"):
                    os.remove(os.path.join(base, name))
        comm.Barrier()
    gib = nbytes / (1 << 30)
    emit(comm, {"benchmark": "checkpoint", "ranks": size, "gib": round(gib, 3),
                "mode": ms.checkpoint.h5write.checkpoint_mode(),
                "save_s": round(ours_save, 3), "raw_write_fsync_s": round(raw_write, 3),
                "save_vs_raw": round(raw_write / ours_save, 3), "save_target": 0.7,
                "restore_s": round(ours_restore, 3), "raw_read_s": round(raw_read, 3),
                "restore_vs_raw": round(raw_read / ours_restore, 3), "restore_target": 0.7,
                "read_cache": cache, "async_blocking_s": round(async_block, 3),
                "async_total_s": round(async_total, 3)})
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
