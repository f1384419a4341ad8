#!/usr/bin/env bash
# Cross-host all-reduce on the namespace cluster: 2 hosts x 2 ranks, links unshaped and then
# shaped to 1gbit; benchmarks/hosts.py prints ours / raw MPI.Allreduce and the bytes that
# crossed each host's link, then benchmarks/collectives.py and benchmarks/percall.py (ours
# against raw mpi4py, same run) with the static rules and with the tuner on
# (MPISTRAT_TUNING=on: calibrated at first use, refined by real calls). Brings its own cluster
# up and takes it down (also on failure). Usage: benchmarks/hosts.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
trap 'scripts/cluster down >/dev/null 2>&1 || true' EXIT
scripts/cluster down >/dev/null 2>&1 || true
scripts/cluster up 2 2
for rate in unshaped 1gbit; do
    if [ "$rate" = unshaped ]; then scripts/cluster shape off; else scripts/cluster shape "$rate"; fi
    PYTHONPATH=$PWD scripts/cluster mpirun --limit 900 -n 4 "$PY" benchmarks/hosts.py \
        --link "$rate" "$@"
    for tuning in off on; do
        echo "{\"hosts\": 2, \"ranks_per_host\": 2, \"link\": \"$rate\", \"tuning\": \"$tuning\"}"
        for bench in collectives percall; do
            MPISTRAT_TUNING=$tuning PYTHONPATH=$PWD scripts/cluster mpirun --limit 900 -n 4 \
                -x MPISTRAT_TUNING "$PY" "benchmarks/$bench.py" "$@"
        done
    done
done
# Hierarchical vs flat ring vs raw MPI.Allreduce (and what auto picks) on real hosts, with the
# bytes read from each host's eth0 counters: 2 hosts x 2 ranks and 3 hosts x 1 rank.
for layout in "2 2" "3 1"; do
    set -- $layout
    scripts/cluster down >/dev/null 2>&1 || true
    scripts/cluster up "$1" "$2"
    for rate in unshaped 1gbit; do
        if [ "$rate" = unshaped ]; then scripts/cluster shape off; else scripts/cluster shape "$rate"; fi
        echo "{\"hosts\": $1, \"ranks_per_host\": $2, \"link\": \"$rate\"}"
        PYTHONPATH=$PWD scripts/cluster mpirun --limit 900 -n $(($1 * $2)) "$PY" \
            benchmarks/hierarchical.py --iface eth0
    done
done
