"""Checkpoint benchmark: save and restore a state of 64 float32 tensors against raw file I/O.

Run: scripts/mpirun -n N .venv/bin/python benchmarks/checkpoint.py [--gib 1.0] [--dir DIR]
Raw baselines (same run, rank 0 alone): numpy.tofile + fsync of the same bytes, and
numpy.fromfile of them; and what users write without us: every rank reading the whole
checkpoint file with h5py. The peak resident memory a restore adds on each rank is sampled. Reads are hot-cache reads unless the page cache could be dropped
(``cache`` in the output says which).
"""

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import drop_caches, emit  # noqa: E402

import mpistrat as ms  # noqa: E402


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest resident set size seen (sampled every 2 ms) while the block runs."""

    def __enter__(self):
        self.value, self._done = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.002):
            self.value = max(self.value, rss_bytes())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.value = max(self.value, rss_bytes())


def read_whole_with_h5py(path: str) -> None:
    """What users write without us: every rank opens the file and reads every dataset."""
    import h5py
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: _read(obj))


def _read(obj) -> None:
    import h5py
    if isinstance(obj, h5py.Dataset):
        obj[()]  # visititems stops at the first callback that returns a value


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
    ours_save = ours_restore = async_block = async_total = every_rank = float("inf")
    extra_rss = 0
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
        before = rss_bytes()
        with PeakRSS() as peak:
            ours_restore = min(ours_restore, timed(comm, lambda: ckpt.restore(latest)))
        extra_rss = max(extra_rss, comm.allreduce(peak.value - before, op=MPI.MAX))
        if rank == 0:
            drop_caches()
        every_rank = min(every_rank, timed(comm, lambda: read_whole_with_h5py(latest + ".h5")))
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
                "restore_vs_raw": round(raw_read / ours_restore, 3),
                "restore_target": 0.8 if size == 1 else 0.7,
                "every_rank_reads_whole_file_s": round(every_rank, 3),
                "restore_vs_every_rank_reads": round(every_rank / ours_restore, 3),
                "restore_peak_extra_rss_mib": round(extra_rss / (1 << 20), 1),
                "restore_rss_target_mib": round((0.1 * nbytes + (64 << 20)) / (1 << 20), 1),
                "read_cache": cache, "async_blocking_s": round(async_block, 3),
                "async_total_s": round(async_total, 3)})
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
