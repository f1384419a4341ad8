"""The predictions of docs/scaling.md: 8 to 1,024 ranks on the InfiniBand-class fat-tree.

``python -m mpistrat.simulate.report --out out/scaling [--docs]`` simulates, for 1 to
128 nodes of 8 ranks (``predict.infiniband``):

* every engine algorithm for 1 KiB to 1 GiB (float32), and the one the engine picks;
* the ResNet-50 gradient set and the 7B bfloat16 gradient set per step, with the
  scaling efficiency of a step of stated compute time (``COMPUTE``);
* the same for one rank per node (where the engine runs its flat ring);

and writes ``predictions.json`` and the figures (``--docs``: into docs/img).
"""

import argparse
import json
import os
import shutil
import sys
import time
from typing import Dict, List

from mpistrat.simulate import programs
from mpistrat.simulate.models import gradient_set
from mpistrat.simulate.predict import PARAMETERS, engine_choice, infiniband, simulate, step

__all__ = ["COMPUTE", "NODES", "SIZES", "grid", "models", "main"]

NODES = [1, 2, 4, 8, 16, 32, 64, 128]
SIZES = [1 << k for k in range(10, 31, 2)]          # 1 KiB .. 1 GiB
# Stated compute time per step, one GPU (the efficiency is compute / (compute + all-reduce)):
COMPUTE = {
    "resnet50": (0.100, "ResNet-50, 256 images per GPU per step at about 2,500 images/s "
                        "(A100 class, mixed precision)"),
    "llama7b": (8.8, "7B decoder, 16 sequences of 2,048 tokens per GPU per step: 6 x 6.74e9 x "
                     "32,768 = 1.3e15 FLOP at 150 TFLOP/s (about half of an A100's bf16 peak)"),
}


def grid(ranks_per_node: int, nodes: List[int], sizes: List[int], **overrides) -> List[dict]:
    """Time of every algorithm and the engine's pick, for every node count and size."""
    rows = []
    for n in nodes:
        spec = infiniband(n, ranks_per_node, **overrides)
        requests = [(a, s, 4) for s in sizes for a in programs.ENGINE_ALGORITHMS]
        times = dict(zip(requests, simulate(spec, requests)))
        for s in sizes:
            chosen, why = engine_choice(spec, s)
            by_algorithm = {a: times[(a, s, 4)] for a in programs.ENGINE_ALGORITHMS}
            best = min(by_algorithm, key=by_algorithm.get)
            rows.append({"nodes": n, "ranks": spec.ranks, "bytes": s, "seconds": by_algorithm,
                         "engine": chosen, "engine_seconds": by_algorithm[chosen],
                         "best": best, "why": why})
    return rows


def models(ranks_per_node: int, nodes: List[int], **overrides) -> List[dict]:
    rows = []
    for name, (compute, _) in COMPUTE.items():
        tensors = gradient_set(name)
        for n in nodes:
            result = step(infiniband(n, ranks_per_node, **overrides), tensors, compute)
            rows.append({"model": name, "nodes": n, "ranks": result["ranks"],
                         "bytes": result["bytes"], "allreduce_seconds":
                             result["allreduce_seconds"], "efficiency": result["efficiency"],
                         "algorithms": sorted({b["algorithm"] for b in result["buckets"]}),
                         "link_bytes": result["link_bytes"]})
    return rows


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 \
        else f"{n >> 10} KiB"


def plot_times(rows: List[dict], path: str, sizes=(1 << 20, 64 << 20, 1 << 30)) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        mine = [r for r in rows if r["bytes"] == size]
        ranks = [r["ranks"] for r in mine]
        for algorithm in programs.ENGINE_ALGORITHMS:
            ax.plot(ranks, [r["seconds"][algorithm] * 1e3 for r in mine], "o-", ms=3,
                    label=algorithm)
        ax.plot(ranks, [r["engine_seconds"] * 1e3 for r in mine], "k*", ms=9,
                label="engine's pick")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (8 per node)")
        ax.set_ylabel("all-reduce (ms)")
        ax.set_title(f"{_size(size)}, InfiniBand-class fat-tree")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_efficiency(model_rows: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in COMPUTE:
        mine = [r for r in model_rows if r["model"] == name]
        ax.plot([r["ranks"] for r in mine], [r["efficiency"] * 100 for r in mine], "o-",
                label=f"{name} ({COMPUTE[name][0]:g} s compute per step)")
    ax.plot([512], [90], "r^", ms=9, label="Horovod, ResNet-101, 512 GPUs (published)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 100)
    ax.set_xlabel("ranks (8 per node)")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title("data-parallel step, all-reduce after compute (no overlap)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpistrat.simulate.report")
    parser.add_argument("--out", default="out/scaling")
    parser.add_argument("--docs", action="store_true", help="copy the figures to docs/img")
    parser.add_argument("--quick", action="store_true", help="4 node counts, 4 sizes")
    args = parser.parse_args(argv)
    nodes = [1, 4, 16, 128] if args.quick else NODES
    sizes = [1 << 10, 1 << 20, 64 << 20, 1 << 30] if args.quick else SIZES
    start = time.perf_counter()
    out: Dict[str, object] = {
        "parameters": {k: {"value": v, "source": s} for k, (v, s) in PARAMETERS.items()},
        "compute": {k: {"seconds": v, "assumption": s} for k, (v, s) in COMPUTE.items()}}
    out["grid"] = grid(8, nodes, sizes)
    out["models"] = models(8, nodes)
    out["one_rank_per_node"] = grid(1, [n for n in (4, 16, 64, 128) if n in nodes or
                                       not args.quick], sizes)
    out["oversubscribed_2"] = models(8, nodes, oversubscription=2.0)
    out["wall_seconds"] = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "predictions.json"), "w") as handle:
        json.dump(out, handle, indent=1)
    plot_times(out["grid"], os.path.join(args.out, "scaling-time.png"))
    plot_efficiency(out["models"], os.path.join(args.out, "scaling-efficiency.png"))
    if args.docs:
        for name in ("scaling-time.png", "scaling-efficiency.png"):
            shutil.copy(os.path.join(args.out, name), os.path.join("docs", "img", name))
    print(f"predictions in {args.out} ({out['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
