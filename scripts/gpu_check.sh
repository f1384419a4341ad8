#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU: scripts/gpu_check.sh PYTHON
#
# PYTHON must hold mpi4py, NumPy, CuPy and JAX with CUDA (h5py optional), as on the GPU machine
# of DESIGN.md section 5; nothing is installed there. Pure-Python helpers it may lack (pytest,
# pytest-mpi, pytest-timeout, tqdm) and the digits data come from out/gpu-check-input, which
#     scripts/gpu_check.sh --prepare        (on a CPU machine with this checkout's .venv)
# fills; carry that folder to the GPU machine (or set MPISTRAT_PYTEST_LIB to a site-packages
# holding them). Parts, one summary line each, in this order:
#   1. tests/mpi with CuPy replica arrays at 1 rank              (NCCL), with tests/gpu's collectives
#   2. tests/mpi with CuPy replica arrays at 2 ranks on the GPU  (staged: NCCL refuses a shared GPU)
#   3. tests/mpi with JAX GPU arrays at 2 ranks, MultiWorkerMirroredStrategy (DLPack, staged)
#   4. tests/tpu at 1 rank: TPUStrategy with the GPU as the JAX device (one device)
#   5. jobs/train.py --replicas cupy at 2 ranks: 1 epoch, then a resume to epoch 2
#   6. jobs/train.py --replicas tpu at 1 rank: 1 epoch, then a resume to epoch 2
#   7. checkpoints of CuPy and JAX GPU arrays saved at 2 ranks, restored at 1 onto the GPU
#   8. benchmarks/gpu.py at 1 and 2 ranks (copies, raw NCCL, ours per backend; JSON lines)
#   9. tests/gpu at 2 simulated nodes x 1 rank (hierarchical: NCCL in each node, MPI across)
# The whole check stays within GPU_CHECK_BUDGET seconds (default 470, under 8 minutes): each
# part runs under the smaller of its own limit and the time left; a part with under 20 s left
# is not started and says so (SKIP). Exits non-zero when any part fails or is skipped.
# GPU_CHECK_ON_CPU=1 runs the plumbing on a machine without a GPU: the CuPy parts use JAX CPU
# arrays instead, GPU-only parts skip or fail (the benchmark needs CuPy).
set -uo pipefail
cd "$(dirname "$0")/.."
input=out/gpu-check-input

if [ "${1:-}" = "--prepare" ]; then    # on a CPU machine: what the GPU machine cannot install
    venv_lib=$(ls -d "$PWD"/.venv/lib/python3*/site-packages | head -n 1)
    rm -rf "$input"; mkdir -p "$input/pylib"
    for p in pytest _pytest pluggy iniconfig packaging py.py pytest_timeout.py pytest_mpi tqdm; do
        [ -e "$venv_lib/$p" ] && cp -r "$venv_lib/$p" "$input/pylib/"
    done
    find "$input/pylib" -name __pycache__ -prune -exec rm -rf {} +
    .venv/bin/python -c "import sys; sys.path.insert(0, 'jobs'); import digits; digits.prepare('$input/data')" \
        || { echo "gpu_check --prepare: could not write the digits data"; exit 1; }
    du -sh "$input"; exit 0
fi

PY=${1:?usage: scripts/gpu_check.sh PYTHON   (or --prepare on a CPU machine)}
out=out/gpu-check
rm -rf "$out"; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Two processes on one GPU: JAX must not grab 75% of the GPU memory each.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
unset MPISTRAT_RANKS_PER_NODE MPISTRAT_TEST_ARRAYS
start=$(date +%s)
budget=${GPU_CHECK_BUDGET:-470}
on_cpu=${GPU_CHECK_ON_CPU:-0}
cupy_kind=cupy; [ "$on_cpu" = 1 ] && cupy_kind=jax

lib=${MPISTRAT_PYTEST_LIB:-}
[ -z "$lib" ] && [ -d "$input/pylib" ] && lib=$PWD/$input/pylib
[ -z "$lib" ] && lib=$(ls -d "$PWD"/.venv/lib/python3*/site-packages 2>/dev/null | head -n 1)
if ! "$PY" -c "import pytest, pytest_mpi, pytest_timeout, tqdm" 2>/dev/null; then
    mkdir -p "$out/pylib"          # only the pure-Python packages, never compiled ones
    for p in pytest _pytest pluggy iniconfig packaging py.py pytest_timeout.py pytest_mpi tqdm; do
        [ -e "$lib/$p" ] && cp -r "$lib/$p" "$out/pylib/"
    done
    export PYTHONPATH=$PYTHONPATH:$PWD/$out/pylib
fi
"$PY" -c "import cupy, mpi4py; print('CuPy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())" \
    || [ "$on_cpu" = 1 ] || { echo "gpu_check: $PY cannot import CuPy and mpi4py"; exit 2; }
"$PY" -c "import jax; print('JAX', jax.__version__, jax.devices())" 2>&1 | tail -n 1

failed=0
left() { echo $((budget - ($(date +%s) - start))); }
limit_for() {  # LIMIT: the part's limit, cut to the time left; empty when under 20 s are left
    local l; l=$(left); [ "$l" -lt 20 ] && return 0
    [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
line() {  # NAME STATUS DETAIL: the part's summary line
    printf '%-40s %-18s %s\n' "$1" "$2" "$3" | tee -a "$out/summary.txt"
}
counts() {  # pytest's closing counts in log $1
    grep -aE "[0-9]+ (passed|failed|errors?|skipped|xfailed)" "$1" 2>/dev/null | tail -n 1 \
        | sed 's/\x1b\[[0-9;]*m//g; s/=//g; s/^ *//'
}
skipped_part() { failed=1; line "$1" "SKIP(no time left)" "$(left) s of the budget left"; }

tests() {  # NAME N LIMIT "ENV=VALUE ..." PYTEST-ARGS...: one multi-rank pytest run
    local name=$1 n=$2 limit envs=$4
    limit=$(limit_for "$3"); shift 4
    [ -z "$limit" ] && { skipped_part "$name"; return; }
    local t0; t0=$(date +%s)
    # shellcheck disable=SC2086
    env $envs scripts/mpirun --limit "$limit" -n "$n" "$PY" scripts/rank_pytest.py \
        "$out/$name" -q -rsx --color=no -p no:cacheprovider --timeout=120 "$@" \
        > "$out/$name.rank0.log" 2>&1
    local rc=$? took=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then
        line "$name" PASS "$(counts "$out/$name.rank0.log") [${took}s]"
    else
        failed=1; line "$name" "FAIL(rc=$rc)" "$(counts "$out/$name.rank0.log") [${took}s]"
        grep -aE "^(FAILED|ERROR)" "$out/$name.rank0.log" | head -n 20
        tail -n 30 "$out/$name".rank*.log
    fi
}

job() {  # NAME N LIMIT EXPECT COMMAND...: a job that must exit 0 and print EXPECT
    local name=$1 n=$2 limit expect=$4
    limit=$(limit_for "$3"); shift 4
    [ -z "$limit" ] && { skipped_part "$name"; return 1; }
    local t0; t0=$(date +%s)
    scripts/mpirun --limit "$limit" -n "$n" "$@" >> "$out/$name.log" 2>&1
    local rc=$? took=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ] && grep -aq -- "$expect" "$out/$name.log"; then
        return 0
    fi
    failed=1; line "$name" "FAIL(rc=$rc)" "expected exit 0 and '$expect': $out/$name.log [${took}s]"
    tail -n 30 "$out/$name.log"; return 1
}

mpi_envs="MPISTRAT_TEST_ARRAYS=$cupy_kind"
tests "1-mpi-cupy-1-rank-nccl" 1 90 "$mpi_envs" tests/mpi tests/gpu/test_gpu_collectives.py
tests "2-mpi-cupy-2-ranks-staged" 2 100 "$mpi_envs" tests/mpi tests/gpu/test_gpu_collectives.py
tests "3-mpi-jax-gpu-2-ranks-mwms" 2 90 "MPISTRAT_TEST_ARRAYS=jax" tests/mpi
# One GPU is one JAX device: the tests that need several devices per host (uneven splits
# across local replicas, a second device's name) cannot run here.
several="each_device_gets_its_rows or short_batches_and_uneven or upstream_initialisation"
several="$several or gather_of_uneven_shapes or components_of_different_shapes"
tests "4-tpu-strategy-on-the-gpu" 1 70 "MPISTRAT_TEST_DEVICES_PER_HOST=1" tests/tpu \
    -k "not ($several)"

data=$input/data
if [ ! -f "$data/train.npy" ]; then   # no prepared digits: write them if scikit-learn is here
    data=$out/data
    "$PY" -c "import sys; sys.path.insert(0, 'jobs'); import digits; digits.prepare('$data')" \
        > "$out/data.log" 2>&1 || echo "gpu_check: no digits data ($out/data.log); run --prepare"
fi
for replicas in cupy tpu; do
    n=2; [ "$replicas" = tpu ] && n=1
    name="$([ $replicas = cupy ] && echo 5 || echo 6)-train-$replicas-$n-rank-resume"
    kind=$replicas; [ "$on_cpu" = 1 ] && [ $replicas = cupy ] && kind=numpy
    args=(jobs/train.py --replicas "$kind" --data "$data" --checkpoint-dir "$out/ckpt-$replicas")
    t0=$(date +%s)
    if job "$name" $n 90 "epoch   1/1" "$PY" "${args[@]}" --epochs 1 \
            && job "$name" $n 90 "resumed from" "$PY" "${args[@]}" --epochs 2; then
        if grep -aq "epoch   2/2" "$out/$name.log"; then
            line "$name" PASS "$(grep -a 'test accuracy:' "$out/$name.log" | tail -n 1) [$(( $(date +%s) - t0 ))s]"
        else
            failed=1; line "$name" FAIL "the resumed run did not reach epoch 2 ($out/$name.log)"
        fi
    fi
done

name=7-checkpoint-cupy-jax-2-to-1-rank
kinds=cupy,jax; [ "$on_cpu" = 1 ] && kinds=jax
t0=$(date +%s)
if job "$name" 2 45 "saved at 2 ranks" "$PY" tests/gpu/checkpoint_widths_job.py save "$out/widths" --kinds $kinds \
        && job "$name" 1 45 "OK" "$PY" tests/gpu/checkpoint_widths_job.py restore "$out/widths" --kinds $kinds; then
    line "$name" PASS "$(grep -ac '^OK' "$out/$name.log") values bit for bit, on the GPU [$(( $(date +%s) - t0 ))s]"
fi

for n in 1 2; do
    name="8-gpu-benchmark-$n-rank"
    limit=$(limit_for 60); [ -z "$limit" ] && { skipped_part "$name"; continue; }
    t0=$(date +%s)
    scripts/mpirun --limit "$limit" -n "$n" "$PY" benchmarks/gpu.py --repeats 3 > "$out/bench$n.json" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        line "$name" PASS "$(grep -c '^{' "$out/bench$n.json") figures [$(( $(date +%s) - t0 ))s]"
        grep '^{' "$out/bench$n.json"
    else
        failed=1; line "$name" "FAIL(rc=$rc)" "[$(( $(date +%s) - t0 ))s]"; tail -n 30 "$out/bench$n.json"
    fi
done
tests "9-gpu-2-nodes-x-1-hierarchical" 2 45 "MPISTRAT_RANKS_PER_NODE=1" tests/gpu/test_gpu_collectives.py
echo "=== gpu_check summary ($(( $(date +%s) - start )) s of a ${budget} s budget)"
cat "$out/summary.txt"
exit $failed
