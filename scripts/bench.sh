#!/usr/bin/env bash
# Run the benchmarks; each prints JSON lines with ratios to a raw baseline from the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/collectives.py
scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/percall.py   # median ratios
for n in 1 2 4; do
    scripts/mpirun --limit 900 -n "$n" .venv/bin/python benchmarks/checkpoint.py --gib 1.0
done
for n in 1 2 4; do
    scripts/mpirun --limit 900 -n "$n" .venv/bin/python benchmarks/input.py --gib 1.0
done
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/tpu_bridge.py | grep -av '^\[Gloo\]'
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/tpu_percall.py | grep -av '^\[Gloo\]'
