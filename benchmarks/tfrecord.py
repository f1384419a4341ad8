"""TFRecord benchmark: ms.data.TFRecordDataset against tf.data.TFRecordDataset and a raw read.

Run: scripts/mpirun -n N .venv/bin/python benchmarks/tfrecord.py [--workload floats|image]
     [--mib 64] [--dir DIR] [--tf-python /work/tfvenv/bin/python]

Rank 0 writes 4 TFRecord files of tf.train.Example records with ms.io (kept between runs):
``floats`` (the default: a 100-float feature, an int64 label, a 32-byte string, about 560
bytes each, ``--mib`` in all) or ``image`` (100,000 records: a 784-byte image, an int64
label, 16 floats and a VarLen list of 0-19 floats). In the same run
it measures, page cache warm, best of 5:

* ``raw``: one process reading every byte of the files (``readinto``), no parsing;
* ``tf_data``: ``tf.data.TFRecordDataset(files).batch(B)`` iterated to the end in a TensorFlow
  Python (subprocess on rank 0; skipped without one), and ``tf.io.parse_example`` of a batch;
* ``ms``: ``TFRecordDataset(files).batch(B)`` on one process, then
  ``experimental_distribute_dataset`` under DATA and FILE at N ranks (global batch B), with the
  record indexes cached (their first build is timed separately);
* ``read_parse``: the same with ``.batch(B).map(parse_example)`` (the workload's features),
  ours at 1 process and distributed under DATA (each rank parses only its rows of a global
  batch), each with a plain and an ``AUTOTUNE`` map, as tf.data's;
* ``parse``: ``ms.io.parse_example`` per record of one batch, and in a subprocess without
  protobuf and google-crc32c, and CRC-32C rates.

One JSON line on rank 0: records per second, ratios to tf.data and to the raw read, and the
bytes each rank read under DATA (its records' bytes plus the index).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, idle_barrier  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.tfformats.record_index import index_path  # noqa: E402

FILES = 4

TF_SCRIPT = r"""
import json, os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
files, batch = json.loads(sys.argv[1]), int(sys.argv[2])
def feature(kind, shape, dtype):
    dtype = getattr(tf, dtype)
    return tf.io.FixedLenFeature(shape, dtype) if kind == "fixed" else tf.io.VarLenFeature(dtype)
features = {k: feature(*v) for k, v in json.loads(sys.argv[3]).items()}
def epoch():
    count = 0
    for b in tf.data.TFRecordDataset(files).batch(batch):
        count += int(b.shape[0])
    return count
epoch()  # warm: the files in the page cache, the pipeline built once
times = []
for _ in range(5):
    start = time.perf_counter(); count = epoch(); times.append(time.perf_counter() - start)
records = next(iter(tf.data.TFRecordDataset(files).batch(batch)))
tf.io.parse_example(records, features)
parse = []
for _ in range(3):
    start = time.perf_counter(); tf.io.parse_example(records, features)
    parse.append(time.perf_counter() - start)
def read_parse(parallel):
    count = 0
    for b in tf.data.TFRecordDataset(files).batch(batch).map(
            lambda r: tf.io.parse_example(r, features), num_parallel_calls=parallel):
        count += int(b["label"].shape[0])
    return count
both = {}
for name, parallel in (("read_parse_seconds", None),
                       ("read_parse_autotune_seconds", tf.data.AUTOTUNE)):
    read_parse(parallel)
    runs = []
    for _ in range(5):
        start = time.perf_counter(); read_parse(parallel); runs.append(time.perf_counter() - start)
    both[name] = min(runs)
print(json.dumps({"seconds": min(times), "records": count, "version": tf.__version__,
                  "parse_per_record_us": min(parse) / int(records.shape[0]) * 1e6, **both}))
"""

FALLBACK_SCRIPT = r"""
import json, sys, time
sys.modules["google.protobuf"] = None
sys.modules["google_crc32c"] = None
import numpy as np, mpistrat as ms
from mpistrat.tfformats import crc, messages
assert messages.backend() == "python" and crc.implementation() == "python"
files, batch = json.loads(sys.argv[1]), int(sys.argv[2])
records = list(ms.data.TFRecordDataset(files).take(batch // 4))
features = {k: ms.io.FixedLenFeature(shape, dtype) if kind == "fixed" else
            ms.io.VarLenFeature(dtype) for k, (kind, shape, dtype) in json.loads(sys.argv[3]).items()}
start = time.perf_counter(); ms.io.parse_example(records, features)
parse = time.perf_counter() - start
data = bytes(1 << 20)
start = time.perf_counter(); crc.crc32c(data); rate = 1 / (time.perf_counter() - start)
print(json.dumps({"parse_per_record_us": parse / len(records) * 1e6, "crc_mib_s": rate}))
"""

# Two workloads: "floats" (100 float32, an int64 label, 32 bytes: about 560 bytes a record)
# and "image" (a 784-byte image, an int64 label, 16 float32 and 0-19 float32 of a VarLen
# feature: about 970 bytes, 100,000 records in all). Each: (kind, shape, dtype) per feature.
WORKLOADS = {
    "floats": {"x": ("fixed", [100], "float32"), "label": ("fixed", [], "int64"),
               "name": ("fixed", [], "string")},
    "image": {"image": ("fixed", [], "string"), "label": ("fixed", [], "int64"),
              "fixed": ("fixed", [16], "float32"), "ragged": ("var", None, "float32")},
}
FEATURES = {}   # the workload's, as ms.io features (set in main)


def ms_features(spec):
    return {k: ms.io.FixedLenFeature(shape, dtype) if kind == "fixed" else
            ms.io.VarLenFeature(dtype) for k, (kind, shape, dtype) in spec.items()}


def _floats_record(rng, k, i, per_file):
    return {"x": rng.standard_normal(100).astype(np.float32), "label": [k * per_file + i],
            "name": [rng.bytes(32)]}


def _image_record(rng, k, i, per_file):
    return {"image": [rng.integers(0, 256, 784, dtype=np.uint8).tobytes()],
            "label": [int(rng.integers(0, 10))],
            "fixed": rng.standard_normal(16).astype(np.float32),
            "ragged": rng.standard_normal(int(rng.integers(0, 20))).astype(np.float32)}


def write_files(directory: str, mib: float, workload: str):
    """4 files of the workload's records (``floats``: ``mib`` MiB; ``image``: 100,000
    records), written once and kept between runs."""
    name = f"{int(mib)}MiB" if workload == "floats" else "image-100k"
    paths = [os.path.join(directory, f"mpistrat-tfrecord-{name}-{k}.tfrecord")
             for k in range(FILES)]
    if all(os.path.exists(p) for p in paths):
        return paths
    rng = np.random.default_rng(0)
    per_file = int(mib * (1 << 20) / FILES / 560) if workload == "floats" else 100_000 // FILES
    make = _floats_record if workload == "floats" else _image_record
    for k, path in enumerate(paths):
        with ms.io.TFRecordWriter(path + ".tmp") as writer:
            for i in range(per_file):
                writer.write(ms.io.serialize_example(make(rng, k, i, per_file)))
        os.replace(path + ".tmp", path)
    return paths


REPEATS = 5


def best_of(fn, repeats=None):
    fn()
    times = []
    for _ in range(repeats or REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def raw_read(paths):
    buffer = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def subprocess_json(python, script, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                          timeout=900, env=env)
    if done.returncode != 0:
        return {"error": done.stderr[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def parsed(dataset, parallel=None):
    """``batch().map(parse_example)``: each rank parses only its rows of a global batch
    (``parallel``: ``num_parallel_calls``, as tf.data's ``AUTOTUNE``)."""
    return dataset.map(lambda records: ms.io.parse_example(records, FEATURES), vectorized=True,
                       num_parallel_calls=parallel)


def distributed_epoch(strategy, paths, batch, policy, parse=False):
    options = ms.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    reader = ms.data.TFRecordDataset(paths)
    dataset = reader.batch(batch)
    dataset = parsed(dataset, ms.data.AUTOTUNE if parse == "autotune" else None) if parse \
        else dataset
    count = 0
    for step in strategy.experimental_distribute_dataset(dataset.with_options(options)):
        count += len(step["label"].values[0] if parse else step.values[0])
    return reader, count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="floats")
    parser.add_argument("--tf-python", default=os.environ.get("MPISTRAT_TEST_TF_PYTHON",
                                                              "/work/tfvenv/bin/python"))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    FEATURES.update(ms_features(WORKLOADS[args.workload]))
    spec = json.dumps(WORKLOADS[args.workload])
    paths = comm.bcast(write_files(args.dir, args.mib, args.workload) if rank == 0 else None,
                       root=0)
    total_bytes = sum(os.path.getsize(p) for p in paths)
    record = {"benchmark": "tfrecord", "workload": args.workload, "ranks": size,
              "files": FILES, "mib": round(sum(os.path.getsize(p) for p in paths) / 2**20, 1),
              "batch": args.batch, "cache": "warm"}
    if rank == 0:
        for path in paths:  # time the index's first build, then keep it cached
            if os.path.exists(index_path(path, None)):
                os.remove(index_path(path, None))
        start = time.perf_counter()
        records = ms.data.TFRecordDataset(paths).num_rows
        record["index_build_seconds"] = time.perf_counter() - start
        record["records"] = records
        record["raw_seconds"] = best_of(lambda: raw_read(paths))
        single = best_of(lambda: sum(len(b) for b in ms.data.TFRecordDataset(paths)
                                     .batch(args.batch)))
        record["ms_1process_seconds"] = single
        record["ms_1process_read_parse_seconds"] = best_of(lambda: sum(
            len(b["label"]) for b in parsed(ms.data.TFRecordDataset(paths).batch(args.batch))))
        record["ms_1process_read_parse_autotune_seconds"] = best_of(lambda: sum(
            len(b["label"]) for b in parsed(ms.data.TFRecordDataset(paths).batch(args.batch),
                                            ms.data.AUTOTUNE)))
        batch = next(iter(ms.data.TFRecordDataset(paths).batch(args.batch)))
        parse = best_of(lambda: ms.io.parse_example(batch, FEATURES))
        record["ms_parse_per_record_us"] = parse / len(batch) * 1e6
        record["ms_python_fallback"] = subprocess_json(sys.executable, FALLBACK_SCRIPT,
                                                       json.dumps(paths), str(args.batch), spec)
        if os.path.exists(args.tf_python):
            record["tf_data"] = subprocess_json(args.tf_python, TF_SCRIPT, json.dumps(paths),
                                                str(args.batch), spec)
    idle_barrier(comm)   # (the other ranks sleep while rank 0 runs alone)
    strategy = ms.MultiWorkerMirroredStrategy()
    runs = [(ms.data.AutoShardPolicy.DATA, False), (ms.data.AutoShardPolicy.FILE, False),
            (ms.data.AutoShardPolicy.DATA, True), (ms.data.AutoShardPolicy.DATA, "autotune")]
    for policy, parse in runs:
        distributed_epoch(strategy, paths, args.batch, policy, parse)   # warm
        times, counts, reader = [], 0, None
        for _ in range(REPEATS):
            comm.Barrier()
            start = time.perf_counter()
            reader, count = distributed_epoch(strategy, paths, args.batch, policy, parse)
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            counts = comm.allreduce(count)
        name = policy.name.lower() + ("_read_parse" if parse else "") + \
            ("_autotune" if parse == "autotune" else "")
        record[f"ms_{name}_seconds"] = min(times)
        record[f"ms_{name}_records"] = counts
        if policy is ms.data.AutoShardPolicy.DATA and not parse:
            record["data_bytes_read_per_rank"] = comm.allgather(reader.bytes_read)
            record["index_bytes_read_per_rank"] = comm.allgather(reader.index_bytes_read)
            record["data_bytes_total"] = total_bytes
    if rank == 0:
        n = record["records"]
        record["raw_records_per_s"] = n / record["raw_seconds"]
        for key in ("ms_1process", "ms_data", "ms_file"):
            record[f"{key}_records_per_s"] = n / record[f"{key}_seconds"]
            record[f"{key}_vs_raw_time"] = record[f"{key}_seconds"] / record["raw_seconds"]
        tf_data = record.get("tf_data", {})
        if "seconds" in tf_data:
            tf_rate = tf_data["records"] / tf_data["seconds"]
            record["tf_data_records_per_s"] = tf_rate
            for key in ("ms_1process", "ms_data", "ms_file"):
                record[f"{key}_vs_tf_data_rate"] = record[f"{key}_records_per_s"] / tf_rate
            for key in ("ms_1process_read_parse", "ms_data_read_parse",   # time ratios
                        "ms_1process_read_parse_autotune", "ms_data_read_parse_autotune"):
                for tf_key in ("read_parse", "read_parse_autotune"):
                    if f"{tf_key}_seconds" in tf_data:
                        record[f"{key}_vs_tf_{tf_key}_time"] = \
                            record[f"{key}_seconds"] / tf_data[f"{tf_key}_seconds"]
        record["data_share_per_rank"] = [b / total_bytes for b in
                                         record["data_bytes_read_per_rank"]]
    emit(comm, record)


if __name__ == "__main__":
    main()
