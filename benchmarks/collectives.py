"""Collective benchmark: mpistrat against raw mpi4py in the same run.

Run: scripts/mpirun -n 2 .venv/bin/python benchmarks/collectives.py [--quick] [--only dtypes]
Prints one JSON object per figure with ``ratio`` = ours / raw baseline (for the dtype figure:
bfloat16 against float32 of the same bytes, and of the same element count).
"""

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import best_seconds, emit  # noqa: E402

import mpistrat as ms  # noqa: E402


def resnet50_shapes():
    """torchvision resnet50's 161 parameter shapes (25,557,032 values)."""
    from mpistrat.simulate.models import gradient_set   # one list, shared with the simulator
    return [shape for shape, _ in gradient_set("resnet50")]


def raw_per_tensor(comm, tensors):
    for t in tensors:
        comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM)


def raw_fused(comm, tensors):
    flat = np.concatenate([t.reshape(-1) for t in tensors])
    comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.size].reshape(t.shape))
        offset += t.size
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for tests)")
    parser.add_argument("--only", choices=["dtypes"], help="run one figure only")
    args = parser.parse_args()
    repeats = 3 if args.quick else 9
    comm = MPI.COMM_WORLD.Dup()
    strategy = ms.MultiWorkerMirroredStrategy()
    n = comm.Get_size()
    if args.only == "dtypes":
        low_precision(comm, strategy, repeats)
        return

    # 1. ResNet-50 gradients
    shapes = resnet50_shapes()
    grads = [np.random.default_rng(i).standard_normal(s).astype(np.float32)
             for i, s in enumerate(shapes)]
    values = sum(g.size for g in grads)
    assert len(grads) == 161 and values == 25_557_032, (len(grads), values)
    per_tensor = best_seconds(comm, lambda: raw_per_tensor(comm, grads), repeats)
    fused = best_seconds(comm, lambda: raw_fused(comm, grads), repeats)
    raw_best = min(per_tensor, fused)
    ours_reduce = best_seconds(comm, lambda: strategy.reduce("SUM", grads, axis=None), repeats)
    ours_ctx = best_seconds(comm, lambda: strategy.run(
        lambda g: ms.get_replica_context().all_reduce("SUM", g), args=(grads,)), repeats)
    for name, ours in [("strategy.reduce", ours_reduce), ("ReplicaContext.all_reduce", ours_ctx)]:
        emit(comm, {"benchmark": "resnet50_gradients", "api": name, "ranks": n,
                    "tensors": len(grads), "values": values, "ours_ms": round(ours * 1e3, 2),
                    "raw_per_tensor_ms": round(per_tensor * 1e3, 2),
                    "raw_fused_ms": round(fused * 1e3, 2),
                    "ratio": round(ours / raw_best, 3), "target": 1.10})

    # 2. 2000 small tensors
    small = [np.full(256, float(i), dtype=np.float32) for i in range(2000)]
    raw_small = best_seconds(comm, lambda: raw_fused(comm, small), repeats)
    raw_small_each = best_seconds(comm, lambda: raw_per_tensor(comm, small), repeats)
    ours_small = best_seconds(comm, lambda: strategy.reduce("SUM", small, axis=None), repeats)
    emit(comm, {"benchmark": "2000x256_float32", "ranks": n, "ours_ms": round(ours_small * 1e3, 3),
                "raw_fused_ms": round(raw_small * 1e3, 3),
                "raw_per_tensor_ms": round(raw_small_each * 1e3, 3),
                "ratio": round(ours_small / raw_small, 3), "target": 1.3})

    # 3. scalar reduce latency
    one = np.ones(1)
    raw_scalar = best_seconds(comm, lambda: comm.Allreduce(MPI.IN_PLACE, one, MPI.SUM),
                              repeats, inner=2000)
    ours_scalar = best_seconds(comm, lambda: strategy.reduce("SUM", 1.0, axis=None),
                               repeats, inner=2000)
    emit(comm, {"benchmark": "scalar_reduce", "ranks": n, "ours_us": round(ours_scalar * 1e6, 2),
                "raw_allreduce_us": round(raw_scalar * 1e6, 2),
                "ratio": round(ours_scalar / raw_scalar, 2), "target_us": 20})

    # 4. large messages: our algorithm choice against MPI's own Allreduce
    engine = strategy.extended.engine
    for mib in ([4, 16] if args.quick else [1, 4, 16, 64]):
        buf = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
        out = np.empty_like(buf)
        raw = best_seconds(comm, lambda: comm.Allreduce(buf, out, MPI.SUM), repeats)
        ours = best_seconds(comm, lambda: engine.all_reduce(buf, "SUM"), repeats)
        emit(comm, {"benchmark": "large_allreduce", "ranks": n, "mib": mib,
                    "ours_ms": round(ours * 1e3, 2), "raw_allreduce_ms": round(raw * 1e3, 2),
                    "ratio": round(ours / raw, 3)})

    low_precision(comm, strategy, repeats)


def low_precision(comm, strategy, repeats: int) -> None:
    """5. bfloat16 all-reduce of 16 MiB (MPI has no bfloat16: it combines in float32 and
    rounds once) against float32 of 16 MiB, and of as many elements (32 MiB)."""
    import ml_dtypes
    engine, n = strategy.extended.engine, comm.Get_size()
    mib = 16
    bf16 = np.ones(mib * (1 << 20) // 2, dtype=ml_dtypes.bfloat16)
    same_bytes = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
    same_count = np.ones(bf16.size, dtype=np.float32)
    times = {name: best_seconds(comm, lambda v=v: engine.all_reduce(v, "SUM"), repeats)
             for name, v in [("bfloat16", bf16), ("float32_same_bytes", same_bytes),
                             ("float32_same_count", same_count)]}
    emit(comm, {"benchmark": "bfloat16_allreduce", "ranks": n, "mib": mib,
                "bfloat16_ms": round(times["bfloat16"] * 1e3, 2),
                "float32_16mib_ms": round(times["float32_same_bytes"] * 1e3, 2),
                "float32_same_count_ms": round(times["float32_same_count"] * 1e3, 2),
                "ratio": round(times["bfloat16"] / times["float32_same_bytes"], 3),
                "ratio_same_count": round(times["bfloat16"] / times["float32_same_count"], 3)})


if __name__ == "__main__":
    main()
