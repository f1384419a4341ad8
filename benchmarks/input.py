"""Input benchmarks, each with a baseline measured in the same run (JSON lines from rank 0).

Run: scripts/mpirun -n N .venv/bin/python benchmarks/input.py [--mode throughput,pipeline,train]

* ``throughput``: aggregate read rate of ``FixedLengthRecordDataset(...).batch(B x N)`` under
  ``experimental_distribute_dataset`` (DATA) against one process reading the whole file with
  ``readinto`` (page cache dropped before each read when permitted; ``cache`` says which).
* ``pipeline`` (issue 19): 60,000 records of 785 bytes (a label byte, 28x28 pixels):
  ``FixedLengthRecordDataset -> global_shuffle(seed=0) | shuffle(10000, seed=0) -> map(decode to
  float32 28x28 and a label) -> batch(256)`` under ``experimental_distribute_dataset``, against
  the same work by hand in NumPy (read the file, a seeded permutation, each rank decodes only its
  rows of each global batch, one small all-reduce per step). Best of 3 epochs each, slowest rank.
  Also: the time to the first batch after restoring the iterator at the first and at the last
  step of an epoch (``resume_*_s``), and bytes read per rank.
* ``train``: ``jobs/train.py --deterministic`` against the ordinary job, same width and epochs.
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

RECORDS, RECORD_BYTES, BATCH = 60_000, 785, 256


def throughput(comm, args):
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.path.join(args.dir, f"mpistrat-input-{int(args.gib * 1024)}MiB.bin")
    records = int(args.gib * (1 << 30)) // args.record_bytes
    if rank == 0 and (not os.path.exists(path) or
                      os.path.getsize(path) != records * args.record_bytes):
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


def decode(records):
    """Stacked 785-byte records -> (float32 images 28x28 in [0, 1], int64 labels)."""
    return (records[:, 1:].reshape(-1, 28, 28).astype(np.float32) * np.float32(1 / 255),
            records[:, 0].astype(np.int64))


def by_hand(comm, path, epoch):
    """The baseline: the whole file, a seeded permutation, this rank's rows of each batch."""
    rank, size = comm.Get_rank(), comm.Get_size()
    data = np.fromfile(path, np.uint8).reshape(RECORDS, RECORD_BYTES)
    order = np.random.default_rng((0, epoch)).permutation(RECORDS)
    mine, total = np.zeros(1), np.zeros(1)
    for start in range(0, RECORDS, BATCH):
        rows = min(BATCH, RECORDS - start)
        per = -(-rows // size)
        a = min(rank * per, rows)
        images, labels = decode(data[order[start + a:start + min(a + per, rows)]])
        mine[0] = len(labels)
        comm.Allreduce(mine, total)


def pipeline(comm, args):
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.path.join(args.dir, "mpistrat-input-785x60000.bin")
    if rank == 0 and (not os.path.exists(path) or
                      os.path.getsize(path) != RECORDS * RECORD_BYTES):
        rows = np.random.default_rng(0).integers(0, 256, (RECORDS, RECORD_BYTES), np.uint8)
        rows[:, 0] %= 10
        rows.tofile(path)
    comm.Barrier()
    strategy = ms.MultiWorkerMirroredStrategy()

    def best(fn, epochs=3):
        times = []
        for epoch in range(epochs):
            comm.Barrier()
            start = time.perf_counter()
            fn(epoch)
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return min(times)

    baseline = best(lambda epoch: by_hand(comm, path, epoch))
    variants = {
        "global_shuffle": lambda r: r.global_shuffle(seed=0).map(decode, vectorized=True)
                                     .batch(BATCH),
        "shuffle_buffer": lambda r: r.shuffle(10000, seed=0).map(decode, vectorized=True)
                                     .batch(BATCH),
        "batch_then_map": lambda r: r.global_shuffle(seed=0).batch(BATCH)
                                     .map(decode, vectorized=True),
        "global_shuffle_prefetch": lambda r: r.global_shuffle(seed=0)
                                              .map(decode, vectorized=True).batch(BATCH)
                                              .prefetch(ms.data.AUTOTUNE),
    }
    record = {"benchmark": "input_pipeline", "ranks": size, "records": RECORDS,
              "record_bytes": RECORD_BYTES, "batch": BATCH, "by_hand_s": round(baseline, 4),
              "target_ratio": 1.5}
    for name, build in variants.items():
        reader = ms.data.FixedLengthRecordDataset([path], RECORD_BYTES)
        distributed = strategy.experimental_distribute_dataset(build(reader))

        def epoch_of(_, distributed=distributed):
            for _batch in distributed:
                pass
        seconds = best(epoch_of)
        record[f"{name}_s"] = round(seconds, 4)
        record[f"{name}_ratio"] = round(seconds / baseline, 3)
        if name == "global_shuffle":
            record["bytes_read_per_rank_per_epoch"] = comm.gather(reader.bytes_read // 3, root=0)
            record.update(resume_times(comm, strategy, path, build))
    emit(comm, record)


def resume_times(comm, strategy, path, build):
    """Seconds to the first batch after restoring at the first and at the last step."""
    steps = -(-RECORDS // BATCH)
    directory = comm.bcast(tempfile.mkdtemp(prefix="mpistrat-resume-") if comm.Get_rank() == 0
                           else None)
    out = {}
    for label, step in (("first", 0), ("last", steps - 1)):
        state = {"epoch": np.array(1), "steps": np.array(step), "seed": np.array(0),
                 "replicas": np.array(comm.Get_size()), "policy": np.array(2)}
        prefix = os.path.join(directory, f"at-{step}")
        ms.Checkpoint(iterator=state).write(prefix)
        best = float("inf")
        for _ in range(3):
            reader = ms.data.FixedLengthRecordDataset([path], RECORD_BYTES)
            iterator = iter(strategy.experimental_distribute_dataset(build(reader)))
            ms.Checkpoint(iterator=iterator).read(prefix)
            comm.Barrier()
            start = time.perf_counter()
            next(iterator)
            best = min(best, comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        out[f"resume_{label}_step_s"] = round(best, 5)
    out["resume_last_over_first"] = round(out["resume_last_step_s"] / out["resume_first_step_s"],
                                          3)
    return out


def train(comm, args):
    """``jobs/train.py`` ordinary and ``--deterministic``: wall time of each, same run."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "jobs"))
    import contextlib
    import io
    import train as job  # noqa: E402
    base = comm.bcast(tempfile.mkdtemp(prefix="mpistrat-train-") if comm.Get_rank() == 0
                      else None)
    times = {}
    for label, extra in (("ordinary", []), ("deterministic", ["--deterministic"]),
                         ("ordinary_again", [])):
        argv = ["--data", os.path.join(base, "data"), "--checkpoint-dir",
                os.path.join(base, label), "--epochs", str(args.train_epochs), *extra]
        comm.Barrier()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            job.main(argv)
        times[label] = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    ordinary = min(times["ordinary"], times["ordinary_again"])   # the first run compiles more
    emit(comm, {"benchmark": "train_deterministic", "ranks": comm.Get_size(),
                "epochs": args.train_epochs, "ordinary_s": round(ordinary, 3),
                "deterministic_s": round(times["deterministic"], 3),
                "ratio": round(times["deterministic"] / ordinary, 3)})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="throughput,pipeline,train")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--record-bytes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--train-epochs", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    modes = set(args.mode.split(","))
    if "throughput" in modes:
        throughput(comm, args)
    if "pipeline" in modes:
        pipeline(comm, args)
    if "train" in modes:
        train(comm, args)


if __name__ == "__main__":
    main()
