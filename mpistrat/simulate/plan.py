"""``python -m mpistrat plan``: a cluster and a model in, the predicted all-reduce per step out.

    python -m mpistrat plan --nodes 64 --ranks-per-node 8 --model resnet50 --compute-seconds 0.1
    python -m mpistrat plan --nodes 16 --nic-gbits 100 --network dragonfly --gradient-bytes 1e9
    python -m mpistrat plan --nodes 8 --tensors 4096x4096:bfloat16,1000:float32 --json
    python -m mpistrat plan --nodes 128 --model llama7b --plot time.png

Prints the buckets (tensors, bytes, the algorithm our engine picks and why, the
simulated time), the total per step, the bytes that cross each kind of link and,
with ``--compute-seconds``, the scaling efficiency; ``--json`` prints the same as
one JSON document; ``--plot PNG`` draws the step's all-reduce time and efficiency
against the rank count (1, 2, 4, ... up to ``--nodes`` nodes). The cluster's
defaults are the InfiniBand-class cluster of docs/scaling.md (``predict.PARAMETERS``).
Nonsense (no nodes, a negative bandwidth, an unknown dtype) is refused with the reason.
"""

import argparse
import json
import math
import sys
from typing import List, Optional, Sequence, Tuple

from mpistrat.simulate.models import MODELS, gradient_set
from mpistrat.simulate.platform import NETWORKS

__all__ = ["main", "parse_tensors", "build_parser", "render"]

MAX_GRADIENT_BYTES = 1e15   # a petabyte of gradient: beyond any model; what the simulation holds

_ITEMSIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
              "int16": 2, "int8": 1, "uint8": 1}
_DTYPES = tuple(_ITEMSIZES)


class PlanError(ValueError):
    """A request ``plan`` refuses, with the reason."""


def parse_tensors(text: str) -> List[Tuple[Tuple[int, ...], str]]:
    """``"4096x4096:bfloat16,10:float32"`` -> ``[((4096, 4096), 'bfloat16'), ((10,), 'float32')]``.

    >>> parse_tensors("3x2:float32, 7:int8")
    [((3, 2), 'float32'), ((7,), 'int8')]
    """
    out, total = [], 0
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        shape_text, _, dtype = item.partition(":")
        dtype = dtype.strip() or "float32"
        if dtype not in _DTYPES:
            raise PlanError(f"tensor {item!r}: unknown dtype {dtype!r}; use one of "
                            f"{', '.join(_DTYPES)}")
        try:
            shape = tuple(int(d) for d in shape_text.lower().split("x"))
        except ValueError:
            raise PlanError(f"tensor {item!r}: a shape is dimensions joined by 'x', e.g. "
                            f"4096x1024") from None
        if any(d < 1 for d in shape):
            raise PlanError(f"tensor {item!r}: every dimension must be 1 or more")
        total += math.prod(shape) * _ITEMSIZES[dtype]
        if total > MAX_GRADIENT_BYTES:
            raise PlanError(f"--tensors: over {MAX_GRADIENT_BYTES:.0e} bytes (a petabyte) in "
                            f"all, at {item!r}")
        out.append((shape, dtype))
    if not out:
        raise PlanError("--tensors lists no tensor")
    return out


def build_parser() -> argparse.ArgumentParser:
    from mpistrat.simulate.predict import PARAMETERS
    p = argparse.ArgumentParser(prog="python -m mpistrat plan",
                                description="Predicted all-reduce time per step on a cluster "
                                            "(simulated with SimGrid; see docs/scaling.md)")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--nic-gbits", type=float, default=PARAMETERS["nic_bandwidth"][0] * 8 / 1e9,
                   help="NIC bandwidth per node and direction, Gbit/s (200)")
    p.add_argument("--nic-latency-us", type=float, default=PARAMETERS["nic_latency"][0] * 1e6)
    p.add_argument("--intra-gbytes", type=float, default=PARAMETERS["intra_bandwidth"][0] / 1e9,
                   help="in-node bandwidth per rank and direction, GB/s (300, NVLink class)")
    p.add_argument("--network", choices=NETWORKS, default="fat-tree")
    p.add_argument("--oversubscription", type=float, default=1.0, help="fat-tree only")
    p.add_argument("--leaf-nodes", type=int, default=PARAMETERS["leaf_nodes"][0])
    p.add_argument("--group-nodes", type=int, default=16, help="dragonfly only")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--gradient-bytes", type=float, help="one float32 gradient of N bytes")
    model.add_argument("--tensors", help="SHAPE:DTYPE,... e.g. 4096x4096:bfloat16,1000:float32")
    model.add_argument("--model", choices=sorted(MODELS), help="a known gradient set")
    p.add_argument("--compute-seconds", type=float, help="compute per step (for efficiency)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--plot", metavar="PNG", help="time and efficiency against ranks")
    return p


def _check(args) -> None:
    problems = []
    if args.nodes < 1:
        problems.append(f"--nodes must be 1 or more, got {args.nodes}")
    if args.ranks_per_node < 1:
        problems.append(f"--ranks-per-node must be 1 or more, got {args.ranks_per_node}")
    for name in ("nic_gbits", "intra_gbytes", "oversubscription"):
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            problems.append(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if not (args.nic_latency_us >= 0 and math.isfinite(args.nic_latency_us)):
        problems.append(f"--nic-latency-us must be 0 or more, got {args.nic_latency_us}")
    if args.leaf_nodes < 1 or args.group_nodes < 1:
        problems.append("--leaf-nodes and --group-nodes must be 1 or more")
    if args.gradient_bytes is not None and not 4 <= args.gradient_bytes <= MAX_GRADIENT_BYTES:
        problems.append(f"--gradient-bytes must be from 4 (one float32) to "
                        f"{MAX_GRADIENT_BYTES:.0e} (a petabyte), got {args.gradient_bytes}")
    if args.compute_seconds is not None and not (args.compute_seconds > 0 and
                                                 math.isfinite(args.compute_seconds)):
        problems.append(f"--compute-seconds must be positive, got {args.compute_seconds}")
    if args.nodes * args.ranks_per_node > 4096:
        problems.append(f"{args.nodes * args.ranks_per_node} ranks: plan simulates up to 4096")
    if problems:
        raise PlanError("; ".join(problems))


def _tensors(args):
    if args.model:
        return gradient_set(args.model)
    if args.tensors:
        return parse_tensors(args.tensors)
    return [((int(args.gradient_bytes) // 4,), "float32")]


def _spec(args, nodes: int):
    from mpistrat.simulate.predict import infiniband
    return infiniband(nodes, args.ranks_per_node, nic_bandwidth=args.nic_gbits * 1e9 / 8,
                      nic_latency=args.nic_latency_us * 1e-6,
                      intra_bandwidth=args.intra_gbytes * 1e9, network=args.network,
                      oversubscription=args.oversubscription, leaf_nodes=args.leaf_nodes,
                      group_nodes=args.group_nodes)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def render(result: dict) -> str:
    """The table ``plan`` prints (pure)."""
    lines = [f"{result['ranks']} ranks on {result['nodes']} node(s), {result['tensors']} "
             f"tensors, {_size(result['bytes'])} per step", "",
             f"{'bucket':>6}  {'tensors':>7}  {'bytes':>10}  {'algorithm':<16}  {'time':>10}"]
    for index, b in enumerate(result["buckets"]):
        lines.append(f"{index:>6}  {b['tensors']:>7}  {_size(b['bytes']):>10}  "
                     f"{b['algorithm']:<16}  {b['seconds'] * 1e3:>7.3f} ms")
    lines += ["", f"all-reduce per step: {result['allreduce_seconds'] * 1e3:.3f} ms"]
    if "efficiency" in result:
        lines.append(f"scaling efficiency with {result['compute_seconds'] * 1e3:g} ms of "
                     f"compute per step: {result['efficiency'] * 100:.1f}%")
    lines += ["", "bytes per step on each kind of link (busiest link; all links of the kind):"]
    for kind, v in result["link_bytes"].items():
        lines.append(f"  {kind:<10} {_size(v['busiest_link']):>10}  {_size(v['all_links']):>10}")
    reasons = dict.fromkeys(f"{b['algorithm']}: {b['why']}" for b in result["buckets"])
    lines += ["", "why:"] + [f"  {r}" for r in reasons]
    return "\n".join(lines) + "\n"


def _plot(args, tensors, path: str) -> List[dict]:
    from mpistrat.simulate.predict import step
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    counts = sorted({1 << k for k in range(args.nodes.bit_length()) if 1 << k <= args.nodes}
                    | {args.nodes})
    series = [step(_spec(args, n), tensors, args.compute_seconds) for n in counts]
    ranks = [s["ranks"] for s in series]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(ranks, [s["allreduce_seconds"] * 1e3 for s in series], "o-", label="all-reduce")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("all-reduce per step (ms)")
    if args.compute_seconds:
        twin = ax.twinx()
        twin.plot(ranks, [s["efficiency"] * 100 for s in series], "s--", color="C1",
                  label="efficiency")
        twin.set_ylabel("scaling efficiency (%)")
        twin.set_ylim(0, 100)
    ax.set_title(f"{args.network}, {args.nic_gbits:g} Gbit/s NICs, {args.ranks_per_node} "
                 f"ranks per node")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check(args)
        tensors = _tensors(args)
        from mpistrat.simulate.player import simgrid_missing
        missing = simgrid_missing()
        if missing:
            raise PlanError(missing)
        from mpistrat.simulate.predict import step
        result = step(_spec(args, args.nodes), tensors, args.compute_seconds)
        if args.plot:
            result["by_nodes"] = [{"ranks": s["ranks"], "allreduce_seconds":
                                   s["allreduce_seconds"], "efficiency": s.get("efficiency")}
                                  for s in _plot(args, tensors, args.plot)]
    except PlanError as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
