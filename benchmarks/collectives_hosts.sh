#!/usr/bin/env bash
# The collective figures of benchmarks/collectives.py and benchmarks/percall.py (ours against
# raw mpi4py, same run) on the namespace cluster: 2 hosts x 2 ranks, links unshaped and then
# shaped to 1gbit, with the static rules and with the tuner on (MPISTRAT_TUNING=on: a
# calibration at first use, refined by real calls). Brings its own cluster up and takes it
# down (also on failure). Usage: benchmarks/collectives_hosts.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
trap 'scripts/cluster down >/dev/null 2>&1 || true' EXIT
scripts/cluster down >/dev/null 2>&1 || true
scripts/cluster up 2 2
for rate in unshaped 1gbit; do
    if [ "$rate" = unshaped ]; then scripts/cluster shape off; else scripts/cluster shape "$rate"; fi
    for tuning in off on; do
        echo "{\"hosts\": 2, \"ranks_per_host\": 2, \"link\": \"$rate\", \"tuning\": \"$tuning\"}"
        for bench in collectives percall; do
            MPISTRAT_TUNING=$tuning PYTHONPATH=$PWD scripts/cluster mpirun --limit 900 -n 4 \
                -x MPISTRAT_TUNING "$PY" "benchmarks/$bench.py" "$@"
        done
    done
done
