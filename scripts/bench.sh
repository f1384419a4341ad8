#!/usr/bin/env bash
# Run the benchmarks; each prints JSON lines with ratios to a raw baseline from the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every line is also kept in out/bench/results.jsonl; plots of it go to docs/img at the end.
mkdir -p out/bench
exec > >(tee out/bench/results.jsonl) 2>&1
scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/collectives.py
scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/percall.py   # median ratios
for n in 1 2 4; do
    scripts/mpirun --limit 900 -n "$n" .venv/bin/python benchmarks/checkpoint.py --gib 1.0
done
for n in 1 2; do   # Keras 3 and optax state against the same arrays saved by hand (issue 16)
    scripts/mpirun --limit 600 -n "$n" .venv/bin/python benchmarks/checkpoint_frameworks.py
done
for n in 1 2; do   # Keras batch inference: predict sharded over ranks against every row per rank
    scripts/mpirun --limit 600 -n "$n" .venv/bin/python benchmarks/keras_predict.py
done
for n in 1 2 4; do
    scripts/mpirun --limit 900 -n "$n" .venv/bin/python benchmarks/input.py --gib 1.0
done
for n in 1 2; do   # TFRecord reads; against tf.data where /work/tfvenv (or --tf-python) has TensorFlow
    scripts/mpirun --limit 900 -n "$n" .venv/bin/python benchmarks/tfrecord.py --mib 64
done
for n in 1 2 4; do
    scripts/mpirun --limit 600 -n "$n" .venv/bin/python benchmarks/train_step.py
done
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/tpu_bridge.py | grep -av '^\[Gloo\]'
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    scripts/mpirun --limit 900 -n 2 .venv/bin/python benchmarks/tpu_percall.py | grep -av '^\[Gloo\]'
benchmarks/hosts.sh   # 2 hosts x 2 ranks on the namespace cluster: unshaped, at 1gbit, tuner off and on
# Hierarchical vs flat ring vs raw MPI.Allreduce: simulated nodes here; the launcher can come
# from outside (MPISTRAT_BENCH_LAUNCH, e.g. the namespace cluster's mpirun with a hostfile).
if [ -n "${MPISTRAT_BENCH_LAUNCH:-}" ]; then  # real hosts: their own layout
    $MPISTRAT_BENCH_LAUNCH .venv/bin/python benchmarks/hierarchical.py
else
    for spec in "2 4" "1 3" "3 4"; do
        set -- $spec
        MPISTRAT_RANKS_PER_NODE=$1 scripts/mpirun --limit 900 -n "$2" .venv/bin/python \
            benchmarks/hierarchical.py
    done
fi
.venv/bin/python scripts/plot_benchmarks.py out/bench/results.jsonl docs/img
