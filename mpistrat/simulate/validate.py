"""Predicted against measured on our namespace cluster: the calibration's check.

``python -m mpistrat.simulate.validate MEASUREMENTS.jsonl --out DIR`` fits the
calibration (``calibrate.fit``), simulates every measured all-reduce (each
algorithm, layout, link setting and size) on the calibrated platform, and writes
``DIR/calibration.json``, ``DIR/validation.json`` (every point, its error),
``DIR/validation.md`` (the error table for docs/scaling.md) and
``DIR/validation.png``. ``--docs`` also copies the figure to ``docs/img/``.

The targets (docs/scaling.md): within 25% for every point above 1 MiB, within 2x below.
"""

import argparse
import json
import os
import shutil
import sys
from typing import Dict, List, Sequence

from mpistrat.simulate import programs
from mpistrat.simulate.calibrate import Calibration, fit, load_records
from mpistrat.simulate.platform import Platform
from mpistrat.simulate.player import play
from mpistrat.simulate.rounds import relabel

__all__ = ["simulate_records", "summary", "table", "main"]

LARGE = 1 << 20   # "above 1 MiB": more than this many bytes


def _layout(layout: str):
    hosts, per_host = (int(x) for x in layout.split("x"))
    return hosts, per_host


def simulate_records(calibration: Calibration, records: Sequence[dict]) -> List[dict]:
    """Every measured all-reduce with its prediction: one simulation per link setting, on a
    platform of as many hosts and ranks per host as the largest layout; a layout of H hosts
    x R ranks runs on the first R ranks of the first H hosts."""
    measured = [r for r in records if r.get("kind") == "allreduce"]
    groups: Dict[str, List[dict]] = {}
    for r in measured:
        groups.setdefault(r["link"], []).append(r)
    rows = []
    for link, points in sorted(groups.items()):
        most_hosts = max(_layout(p["layout"])[0] for p in points)
        most_ranks = max(_layout(p["layout"])[1] for p in points)
        platform = Platform(calibration.spec((most_ranks,) * most_hosts, link))

        def job(point):
            hosts, per_host = _layout(point["layout"])
            nodes = [h for h in range(hosts) for _ in range(per_host)]
            ranks = [most_ranks * h + j for h in range(hosts) for j in range(per_host)]
            return relabel(programs.rounds(point["ran"], point["bytes"] // 4, 4, nodes), ranks)

        for p, seconds in zip(points, play(platform, [lambda p=p: job(p) for p in points])):
            rows.append({"layout": p["layout"], "link": link, "algorithm": p["algorithm"],
                         "ran": p["ran"], "bytes": p["bytes"], "measured_s": p["seconds"],
                         "predicted_s": seconds, "error": seconds / p["seconds"] - 1})
    return rows


def summary(rows: Sequence[dict]) -> dict:
    """Worst errors above and below 1 MiB, and how many points meet the targets."""
    large = [r for r in rows if r["bytes"] > LARGE]
    small = [r for r in rows if r["bytes"] <= LARGE]
    factor = [max(r["predicted_s"] / r["measured_s"], r["measured_s"] / r["predicted_s"])
              for r in small]
    return {"points": len(rows),
            "above_1MiB": len(large),
            "above_1MiB_within_25pct": sum(abs(r["error"]) <= 0.25 for r in large),
            "above_1MiB_worst_error": max((abs(r["error"]) for r in large), default=0.0),
            "above_1MiB_median_error": _median([abs(r["error"]) for r in large]),
            "upto_1MiB": len(small),
            "upto_1MiB_within_2x": sum(f <= 2 for f in factor),
            "upto_1MiB_worst_factor": max(factor, default=1.0)}


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def table(rows: Sequence[dict]) -> str:
    """Markdown: one row per layout, link and algorithm; one column per size (error %)."""
    sizes = sorted({r["bytes"] for r in rows})
    keyed = {(r["layout"], r["link"], r["algorithm"], r["bytes"]): r for r in rows}
    lines = ["| hosts x ranks | links | algorithm | " + " | ".join(_size(s) for s in sizes) + " |",
             "|---|---|---|" + "---:|" * len(sizes)]
    for layout, link, algorithm in sorted({k[:3] for k in keyed}):
        cells = []
        for s in sizes:
            r = keyed.get((layout, link, algorithm, s))
            cells.append("" if r is None else f"{r['error'] * 100:+.0f}%")
        lines.append(f"| {layout} | {link} | {algorithm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], path: str) -> None:
    """Predicted against measured, log-log, one panel per link setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 5), squeeze=False)
    for ax, link in zip(axes[0], links):
        mine = [r for r in rows if r["link"] == link]
        for algorithm in programs.ENGINE_ALGORITHMS:
            points = [r for r in mine if r["algorithm"] == algorithm]
            ax.scatter([r["measured_s"] * 1e3 for r in points],
                       [r["predicted_s"] * 1e3 for r in points], s=14, label=algorithm)
        low = min(min(r["measured_s"], r["predicted_s"]) for r in mine) * 1e3
        high = max(max(r["measured_s"], r["predicted_s"]) for r in mine) * 1e3
        ax.plot([low, high], [low, high], "k-", lw=0.8)
        ax.plot([low, high], [low * 1.25, high * 1.25], "k:", lw=0.6)
        ax.plot([low, high], [low * 0.75, high * 0.75], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured (ms, slowest rank, best of repeats)")
        ax.set_ylabel("simulated (ms)")
        ax.set_title(f"namespace cluster, {link} links (2x1, 2x2, 3x1, 4x1)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpistrat.simulate.validate")
    parser.add_argument("measurements", help="JSON lines of benchmarks/calibrate_sim.py")
    parser.add_argument("--out", default="out/calibration")
    parser.add_argument("--docs", action="store_true", help="copy the figure to docs/img")
    args = parser.parse_args(argv)
    with open(args.measurements) as handle:
        records = load_records(handle)
    wrong = [r for r in records if r.get("kind") == "allreduce" and not r.get("correct", True)]
    if wrong:
        print(f"validate: {len(wrong)} measured all-reduces gave wrong results, e.g. {wrong[0]}",
              file=sys.stderr)
        return 1
    calibration = fit(records)
    rows = simulate_records(calibration, records)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "calibration.json"), "w") as handle:
        handle.write(calibration.to_json() + "\n")
    result = {"summary": summary(rows), "rows": rows}
    with open(os.path.join(args.out, "validation.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    with open(os.path.join(args.out, "validation.md"), "w") as handle:
        handle.write(table(rows))
    figure = os.path.join(args.out, "validation.png")
    plot(rows, figure)
    if args.docs:
        shutil.copy(figure, os.path.join("docs", "img", "scaling-validation.png"))
    print(calibration.to_json())
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
