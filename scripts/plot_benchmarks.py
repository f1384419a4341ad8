"""Plots of the benchmarks' JSON lines: one PNG per benchmark, ratios to the raw baseline.

Run: .venv/bin/python scripts/plot_benchmarks.py out/bench/results.jsonl docs/img
(``make bench`` writes the JSON lines there and runs this). Every numeric field whose name
says it is a ratio (``ratio``, ``*_vs_*``) becomes a bar; a ``target`` field (or
``*_target``) becomes a dashed line. Lines that are not JSON objects are skipped.
"""

import json
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# fields that tell two records of one benchmark apart, in the order they are shown
LABEL_FIELDS = ("api", "figure", "loop", "layout", "link", "algorithm", "size", "mib", "gib",
                "ranks", "mode")


def records(path: str):
    """The JSON objects of a file of JSON lines."""
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def label_of(record: dict) -> str:
    return " ".join(f"{k}={record[k]}" for k in LABEL_FIELDS if k in record)


def ratio_fields(record: dict):
    return [k for k, v in record.items() if isinstance(v, (int, float)) and not
            isinstance(v, bool) and ("ratio" in k or "_vs_" in k) and "target" not in k]


def plot(name: str, rows: list, out_dir: str) -> str:
    fields = sorted({f for r in rows for f in ratio_fields(r)})
    labels = [label_of(r) for r in rows]
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.4 * len(rows) * max(len(fields), 1))), 4.8))
    width = 0.8 / max(len(fields), 1)
    for i, field in enumerate(fields):
        xs = [x + i * width for x in range(len(rows))]
        ax.bar(xs, [r.get(field, 0) for r in rows], width, label=field)
    targets = {r.get("target") or next((v for k, v in r.items() if k.endswith("_target")
                                        and isinstance(v, (int, float))), None) for r in rows}
    for target in sorted(t for t in targets if t):
        ax.axhline(target, linestyle="--", color="grey", linewidth=1)
        ax.text(len(rows) - 0.5, target, f" target {target}", va="bottom", fontsize=8)
    ax.set_xticks([x + width * (len(fields) - 1) / 2 for x in range(len(rows))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("ratio to the raw baseline (same run)")
    ax.set_title(f"mpistrat benchmark: {name}")
    if fields:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"bench-{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    groups = defaultdict(list)
    for record in records(argv[1]):
        if "benchmark" in record and ratio_fields(record):
            groups[record["benchmark"]].append(record)
    os.makedirs(argv[2], exist_ok=True)
    for name, rows in sorted(groups.items()):
        print(plot(name, rows, argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
