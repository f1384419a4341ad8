#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU: scripts/gpu_check.sh PYTHON
#
# PYTHON must hold mpi4py, NumPy, CuPy (JAX and h5py optional), as on the GPU machine of
# DESIGN.md section 5; nothing is installed. pytest and pytest-mpi, when PYTHON lacks them,
# are taken (pure-Python packages only) from $MPISTRAT_PYTEST_LIB, a site-packages directory,
# or else from this checkout's .venv. Parts, one summary line each:
#   1. GPU tests at 1 rank                 (NCCL path)
#   2. GPU tests at 2 ranks on the one GPU (staged path: NCCL refuses a shared GPU)
#   3. GPU tests at 2 simulated nodes x 1  (hierarchical: NCCL in each node, MPI across)
#   4. CuPy checkpoint round trip          (2 ranks)
#   5. CuPy dataset batches                (2 ranks)
#   6. benchmarks/gpu.py at 1 and 2 ranks  (copies, raw NCCL, ours per backend)
# Exits non-zero when any part fails. Under 5 minutes: every part runs under a limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/gpu_check.sh PYTHON}
out=out/gpu-check
rm -rf "$out"; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Two processes on one GPU: JAX must not grab 75% of the GPU memory each.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
unset MPISTRAT_RANKS_PER_NODE

if ! "$PY" -c "import pytest, pytest_mpi" 2>/dev/null; then
    lib=${MPISTRAT_PYTEST_LIB:-$(ls -d "$PWD"/.venv/lib/python3*/site-packages 2>/dev/null | head -n 1)}
    mkdir -p "$out/pylib"
    for p in pytest _pytest pluggy iniconfig packaging py.py pytest_timeout.py pytest_mpi; do
        [ -e "$lib/$p" ] && cp -r "$lib/$p" "$out/pylib/"
    done
    export PYTHONPATH=$PYTHONPATH:$PWD/$out/pylib
fi
# GPU_CHECK_ON_CPU=1 runs the plumbing on a machine without a GPU (tests skip, benchmark fails).
"$PY" -c "import cupy, mpi4py; print('CuPy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())" \
    || [ "${GPU_CHECK_ON_CPU:-0}" = 1 ] || { echo "gpu_check: $PY cannot import CuPy and mpi4py"; exit 2; }

failed=0
summary() {  # NAME STATUS LOG
    local line
    line=$(grep -aE "[0-9]+ (passed|failed|errors?|skipped)" "$3" 2>/dev/null | tail -n 1 \
        | sed 's/\x1b\[[0-9;]*m//g')
    printf '%-44s %s %s\n' "$1" "$2" "${line:-(see $3)}" | tee -a "$out/summary.txt"
}

tests() {  # NAME N LIMIT "ENV=VALUE ..." PYTEST-ARGS...: one multi-rank pytest run
    local name=$1 n=$2 limit=$3 envs=$4; shift 4
    # shellcheck disable=SC2086
    env $envs scripts/mpirun --limit "$limit" -n "$n" "$PY" scripts/rank_pytest.py \
        "$out/$name" -q -rs -p no:cacheprovider "$@" > "$out/$name.rank0.log" 2>&1
    local rc=$?
    if [ $rc -eq 0 ] && ! grep -aq "skipped" "$out/$name.rank0.log"; then
        summary "$name" PASS "$out/$name.rank0.log"
    elif [ $rc -eq 0 ]; then  # a skip on a GPU machine means something is missing: say so
        summary "$name" "PASS(with skips)" "$out/$name.rank0.log"
    else
        failed=1; summary "$name" "FAIL(rc=$rc)" "$out/$name.rank0.log"
        tail -n 40 "$out/$name".rank*.log
    fi
}

tests "1-rank-nccl" 1 60 "" tests/gpu/test_gpu_collectives.py
tests "2-ranks-shared-gpu-staged" 2 60 "" tests/gpu/test_gpu_collectives.py
tests "2-nodes-x-1-hierarchical" 2 60 "MPISTRAT_RANKS_PER_NODE=1" tests/gpu/test_gpu_collectives.py
tests "cupy-checkpoint-round-trip" 2 60 "" tests/gpu/test_gpu_data_checkpoint.py -k round_trip
tests "cupy-dataset-batches" 2 60 "" tests/gpu/test_gpu_data_checkpoint.py -k dataset

for n in 1 2; do
    scripts/mpirun --limit 90 -n "$n" "$PY" benchmarks/gpu.py --repeats 3 > "$out/bench$n.json" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        printf '%-44s %s %s\n' "gpu-benchmark-$n-rank" PASS "$(grep -c '^{' "$out/bench$n.json") figures" \
            | tee -a "$out/summary.txt"
        grep '^{' "$out/bench$n.json"
    else
        failed=1
        printf '%-44s %s\n' "gpu-benchmark-$n-rank" "FAIL(rc=$rc)" | tee -a "$out/summary.txt"
        tail -n 30 "$out/bench$n.json"
    fi
done
echo "=== gpu_check summary"; cat "$out/summary.txt"
exit $failed
