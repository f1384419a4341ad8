"""GPU benchmark: copy bandwidth, raw NCCL at 1 rank, and our backends, same run.

Run (by scripts/gpu_check.sh): ``scripts/mpirun -n 1 PYTHON benchmarks/gpu.py`` and
``-n 2`` (ranks sharing the GPU: the staged path). Prints one JSON line per figure:

* ``copy``: pinned and pageable host<->device bandwidth for 4 KiB, 1 MiB, 256 MiB;
* ``raw_nccl`` (1 rank): ``ncclAllReduce`` per call, stream-synchronised;
* ``ours``: ``engine.all_reduce`` of a CuPy array for each usable backend, with
  ``over_raw_us`` (per call, against raw NCCL; target within 10 us) or, for the
  staged path, ``ratio_to_hand_staged`` (copy down, host ``Allreduce``, copy up,
  written by hand in the same run; DESIGN.md measured 268 ms at 256 MiB, 2 ranks).
"""

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import best_seconds, emit  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.collectives import CollectiveEngine, CommunicationOptions  # noqa: E402
from mpistrat.collectives.backends import explain_backend  # noqa: E402
from mpistrat.collectives.topology import comm_topology  # noqa: E402
from mpistrat.runtime.devices import capabilities  # noqa: E402

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "256MiB": 256 << 20}


def synced(fn):
    import cupy

    def run():
        fn()
        cupy.cuda.get_current_stream().synchronize()
    return run


def copy_bandwidth(comm, repeats):
    import cupy
    import cupyx
    for label, nbytes in SIZES.items():
        device = cupy.empty(nbytes, cupy.uint8)
        pinned = cupyx.empty_pinned(nbytes, np.uint8)
        pageable = np.empty(nbytes, np.uint8)
        figures = {}
        for name, host in (("pinned", pinned), ("pageable", pageable)):
            down = best_seconds(comm, synced(lambda h=host: device.get(out=h)), repeats)
            up = best_seconds(comm, synced(lambda h=host: device.set(h)), repeats)
            figures[f"{name}_down_GBps"] = round(nbytes / down / 1e9, 2)
            figures[f"{name}_up_GBps"] = round(nbytes / up / 1e9, 2)
        emit(comm, {"benchmark": "gpu_copy", "size": label, **figures})


def raw_nccl_seconds(nbytes, repeats):
    """ncclAllReduce on a 1-rank communicator of this process (COMM_SELF)."""
    import cupy
    from cupy.cuda import nccl
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x = cupy.ones(nbytes // 4, cupy.float32)
    y = cupy.empty_like(x)
    stream = cupy.cuda.get_current_stream()
    fn = synced(lambda: comm.allReduce(x.data.ptr, y.data.ptr, x.size, nccl.NCCL_FLOAT32,
                                       nccl.NCCL_SUM, stream.ptr))
    seconds = best_seconds(MPI.COMM_SELF, fn, repeats, inner=20 if nbytes < (64 << 20) else 1)
    comm.destroy()
    return seconds


def hand_staged_seconds(comm, nbytes, repeats):
    """Copy down into pinned memory, host Allreduce (MPI's own), copy up: by hand."""
    import cupy
    import cupyx
    x = cupy.ones(nbytes // 4, cupy.float32)
    host = cupyx.empty_pinned(x.size, np.float32)

    def run():
        x.get(out=host)
        comm.Allreduce(MPI.IN_PLACE, host, MPI.SUM)
        x.set(host)
    return best_seconds(comm, synced(run), repeats)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import cupy
    strategy = ms.MultiWorkerMirroredStrategy()  # binds this rank to its GPU first
    comm = strategy.extended.engine.comm
    size = comm.Get_size()
    topology = comm_topology(comm)
    copy_bandwidth(comm, args.repeats)
    raw = {}
    if size == 1:
        for label, nbytes in SIZES.items():
            raw[label] = raw_nccl_seconds(nbytes, args.repeats)
            emit(comm, {"benchmark": "gpu_raw_nccl", "size": label,
                        "us": round(raw[label] * 1e6, 1)})
    for implementation in ("AUTO", "MPI", "NCCL"):
        try:
            backend, why = explain_backend("cupy", ms.CommunicationImplementation[implementation],
                                           capabilities(), topology)
        except ValueError:
            continue
        if implementation == "NCCL" and topology.gpu_shared_in_node:
            continue  # NCCL refuses two ranks on one GPU (tested in tests/gpu)
        engine = CollectiveEngine(comm, CommunicationOptions(implementation=implementation))
        for label, nbytes in SIZES.items():
            x = cupy.ones(nbytes // 4, cupy.float32)
            inner = 20 if nbytes < (64 << 20) else 1
            ours = best_seconds(comm, synced(lambda: engine.all_reduce(x, "SUM")), args.repeats,
                                inner=inner)
            record = {"benchmark": "gpu_ours", "ranks": size, "implementation": implementation,
                      "backend": backend.name, "size": label, "us": round(ours * 1e6, 1)}
            if label in raw and backend.name == "nccl":
                record["raw_nccl_us"] = round(raw[label] * 1e6, 1)
                record["over_raw_us"] = round((ours - raw[label]) * 1e6, 1)
            if backend.name == "staged-host-mpi":
                hand = hand_staged_seconds(comm, nbytes, args.repeats)
                record["hand_staged_us"] = round(hand * 1e6, 1)
                record["ratio_to_hand_staged"] = round(ours / hand, 3)
            emit(comm, record)
    comm.Barrier()
    time.sleep(0.1)


if __name__ == "__main__":
    main()
