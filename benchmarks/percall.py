"""Per-call cost of the collective API against raw mpi4py, as median ratios.

Run: scripts/mpirun -n 2 .venv/bin/python benchmarks/percall.py [--quick]

Each repeat times ours and the raw baseline back to back (the slowest rank's
time, after a barrier), so both see the same load on a shared machine; each
figure is the median over repeats of ours / raw. Figures:

* ``2000x256``: ``strategy.reduce`` of 2000 float32 tensors of 256 values against
  raw pack (``np.concatenate``) + in-place ``Allreduce`` + unpack (views).
* ``resnet50``: ``strategy.reduce`` of the ResNet-50 gradient set (161 tensors)
  against the raw per-tensor in-place ``Allreduce`` loop.
* ``scalar``: ``strategy.reduce("SUM", 1.0)`` against a raw ``Allreduce`` of one double.
* ``scalar_float32``, ``scalar_jax``, ``float32x8``: ``strategy.reduce("MEAN", ...)`` of a
  NumPy float32 scalar (a loss), a JAX float32 scalar and a float32 array of 8 values,
  against the same raw ``Allreduce`` (``--only small`` runs these alone).
* ``deterministic_16MiB``: the engine's reproducible SUM of 16 MiB of float32 against
  its ordinary SUM (and raw ``Allreduce``), when the library has it.
* ``resnet50_into``: the same set reduced in place, ``engine.all_reduce(grads, "SUM",
  out=grads)``, against the same baseline (the caller's own buffers, as the baseline's)
* ``timeline_resnet50``: ``strategy.reduce`` of the ResNet-50 set with the timeline
  recording against the same with it off, when the library has it.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from collectives import raw_fused, raw_per_tensor, resnet50_shapes  # noqa: E402
from common import emit  # noqa: E402

import mpistrat as ms  # noqa: E402


def timed(comm, fn, inner):
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return comm.allreduce((time.perf_counter() - start) / inner, op=MPI.MAX)


def compare(comm, ours, raw, repeats, inner=1):
    """Median of per-repeat ratios, and median times, ours and raw back to back."""
    ours(), raw()  # warm up
    pairs = []
    for k in range(repeats):
        if k % 2:
            o = timed(comm, ours, inner)
            r = timed(comm, raw, inner)
        else:
            r = timed(comm, raw, inner)
            o = timed(comm, ours, inner)
        pairs.append((o, r))
    return (statistics.median(o / r for o, r in pairs), statistics.median(o for o, _ in pairs),
            statistics.median(r for _, r in pairs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--label", default="", help="a tag for the JSON lines (before/after)")
    parser.add_argument("--only", choices=["small"], help="run the small-reduction figures only")
    args = parser.parse_args()
    repeats = 5 if args.quick else 11
    comm = MPI.COMM_WORLD.Dup()
    n = comm.Get_size()
    strategy = ms.MultiWorkerMirroredStrategy()
    base = {"ranks": n, "label": args.label}
    if args.only == "small":
        small_reductions(comm, strategy, base, repeats)
        return

    small = [np.full(256, float(i), dtype=np.float32) for i in range(2000)]
    ratio, ours, raw = compare(comm, lambda: strategy.reduce("SUM", small, axis=None),
                               lambda: raw_fused(comm, small), repeats)
    emit(comm, {"figure": "2000x256", **base, "ours_ms": round(ours * 1e3, 3),
                "raw_pack_allreduce_unpack_ms": round(raw * 1e3, 3), "ratio": round(ratio, 3),
                "target": 1.2})

    grads = [np.random.default_rng(i).standard_normal(s).astype(np.float32)
             for i, s in enumerate(resnet50_shapes())]
    ratio, ours, raw = compare(comm, lambda: strategy.reduce("SUM", grads, axis=None),
                               lambda: raw_per_tensor(comm, grads), repeats)
    emit(comm, {"figure": "resnet50", **base, "ours_ms": round(ours * 1e3, 2),
                "raw_per_tensor_inplace_ms": round(raw * 1e3, 2), "ratio": round(ratio, 3),
                "target": 1.05})

    engine = strategy.extended.engine
    ratio, ours, raw = compare(comm, lambda: engine.all_reduce(grads, "SUM", out=grads),
                               lambda: raw_per_tensor(comm, grads), repeats)
    emit(comm, {"figure": "resnet50_into", **base, "ours_ms": round(ours * 1e3, 2),
                "raw_per_tensor_inplace_ms": round(raw * 1e3, 2), "ratio": round(ratio, 3),
                "target": 1.0})

    one = np.ones(1)
    ratio, ours, raw = compare(comm, lambda: strategy.reduce("SUM", 1.0, axis=None),
                               lambda: comm.Allreduce(MPI.IN_PLACE, one, MPI.SUM), repeats,
                               inner=2000)
    emit(comm, {"figure": "scalar", **base, "ours_us": round(ours * 1e6, 2),
                "raw_allreduce_us": round(raw * 1e6, 2), "ratio": round(ratio, 2),
                "target_us": 5})

    if "deterministic" in ms.CommunicationOptions.__dataclass_fields__:
        engine = strategy.extended.engine
        exact = ms.CommunicationOptions(deterministic=True)
        big = np.random.default_rng(1).standard_normal(4 << 20).astype(np.float32)  # 16 MiB
        ratio, ours, plain = compare(comm, lambda: engine.all_reduce(big, "SUM", exact),
                                     lambda: engine.all_reduce(big, "SUM"), repeats)
        out = np.empty_like(big)
        _, _, raw = compare(comm, lambda: None, lambda: comm.Allreduce(big, out, MPI.SUM), 3)
        emit(comm, {"figure": "deterministic_16MiB", **base, "ours_ms": round(ours * 1e3, 2),
                    "nondeterministic_ms": round(plain * 1e3, 2),
                    "raw_allreduce_ms": round(raw * 1e3, 2), "ratio": round(ratio, 3),
                    "target": 2.0})

    try:
        from mpistrat.runtime import timeline
    except ImportError:
        timeline = None
    if timeline is not None:
        def with_timeline():
            with timeline.recording():
                strategy.reduce("SUM", grads, axis=None)
        ratio, ours, off = compare(comm, with_timeline,
                                   lambda: strategy.reduce("SUM", grads, axis=None), repeats)
        emit(comm, {"figure": "timeline_resnet50", **base, "on_ms": round(ours * 1e3, 2),
                    "off_ms": round(off * 1e3, 2), "ratio": round(ratio, 3), "target": 1.05})

    small_reductions(comm, strategy, base, repeats)


def small_reductions(comm, strategy, base, repeats) -> None:
    """The per-call cost of the small reductions a training loop makes (losses, metrics)."""
    import jax.numpy as jnp
    one = np.ones(1)
    values = [("scalar_float", 1.0), ("scalar_float32", np.float32(0.5)),
              ("scalar_jax", jnp.float32(0.5)), ("float32x8", np.ones(8, np.float32))]
    for name, value in values:
        ratio, ours, raw = compare(comm, lambda v=value: strategy.reduce("MEAN", v, axis=None),
                                   lambda: comm.Allreduce(MPI.IN_PLACE, one, MPI.SUM), repeats,
                                   inner=1000)
        emit(comm, {"figure": name, **base, "ours_us": round(ours * 1e6, 2),
                    "raw_allreduce_us": round(raw * 1e6, 2), "ratio": round(ratio, 2),
                    "target_us": 3})


if __name__ == "__main__":
    main()
