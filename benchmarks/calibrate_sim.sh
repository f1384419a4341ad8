#!/usr/bin/env bash
# Calibrate the simulator on the namespace cluster and check it: one command, about 5 to
# 10 minutes. Brings up 4 hosts x 2 ranks under the cluster session lock, measures
# (benchmarks/calibrate_sim.py) at 2x1, 2x2, 3x1 and 4x1 hosts, links unshaped and then
# shaped to 1 Gbit/s, takes the cluster down (also on failure), then fits the parameters
# and simulates every measured point (python -m mpistrat.simulate.validate).
# Usage: benchmarks/calibrate_sim.sh [OUT_DIR]   (default out/calibration)
# Writes OUT_DIR/measurements.jsonl (raw), calibration.json, validation.json, and the
# figures; the docs' copies are made by: python -m mpistrat.simulate.validate --docs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/calibration}; [ $# -gt 0 ] && shift
PY=$PWD/.venv/bin/python
mkdir -p "$OUT"
RAW=$OUT/measurements.jsonl
exec 8>/tmp/mpistrat-cluster-session.lock
flock -w 1800 8 || { echo "calibrate_sim: the cluster is busy (lock held 30 min)"; exit 1; }
trap 'scripts/cluster down >/dev/null 2>&1 || true' EXIT
scripts/cluster down >/dev/null 2>&1 || true
scripts/cluster up 4 2
: > "$RAW"
start=$(date +%s)
for link in unshaped 1gbit; do
    if [ "$link" = unshaped ]; then scripts/cluster shape off; else scripts/cluster shape "$link"; fi
    for layout in 2x1 3x1 4x1 2x2; do
        echo "calibrate_sim: $layout, $link ($(( $(date +%s) - start )) s so far)" >&2
        PYTHONPATH=$PWD scripts/cluster mpirun --limit 300 --layout "$layout" "$PY" \
            benchmarks/calibrate_sim.py --link "$link" "$@" >> "$RAW"
    done
done
scripts/cluster down
trap - EXIT
echo "calibrate_sim: measured in $(( $(date +%s) - start )) s; fitting and simulating" >&2
PYTHONPATH=$PWD "$PY" -m mpistrat.simulate.validate "$RAW" --out "$OUT"
