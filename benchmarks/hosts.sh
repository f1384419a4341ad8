#!/usr/bin/env bash
# Cross-host all-reduce on the namespace cluster: 2 hosts x 2 ranks, links unshaped and then
# shaped to 1gbit; benchmarks/hosts.py prints ours / raw MPI.Allreduce and the bytes that
# crossed each host's link. Brings its own cluster up and takes it down (also on failure).
# Usage: benchmarks/hosts.sh [--quick]
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
done
