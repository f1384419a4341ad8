#!/usr/bin/env bash
# The whole test suite: set-up, single-process tests (unit and launcher
# tests), then the multi-rank tests under mpirun at 1, 2, 3 and 4 ranks.
# Every mpirun runs under a time limit; pytest-timeout dumps the stacks of a
# test that hangs, and the logs of every rank are shown when a run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# MPICH's Debian packages now, in the foreground (apt may ask for sudo's password); its
# environment is built later, in the background (mpich_first below).
bash scripts/setup.sh --mpi mpich --packages-only || echo "setup: MPICH's packages failed; the MPICH stage will say so"
PY=$PWD/.venv/bin/python
# The package's bytecode, compiled once (again only for files that changed). Where
# PYTHONDONTWRITEBYTECODE is set, as on this project's CI machines, Python reads .pyc files but
# never writes them, so every process the suite starts compiled mpistrat's 170 modules from
# source: 0.5 s of each start-up (tests/launcher/test_info.py and test_settings_jobs.py took 70 s
# instead of 51 s).
"$PY" -m compileall -q mpistrat >/dev/null || exit 1
export PYTHONUNBUFFERED=1
logs=out/test-logs
rm -rf "$logs"; mkdir -p "$logs"
failed_runs=""
# JAX's persistent compilation cache for the multi-rank runs of tests/mpi and tests/tpu (ranks_run,
# below), emptied here: each of those runs compiled the same Keras/Flax steps and mesh programs
# again at each width and under each MPI, and a program read back is the one XLA compiled. Only
# there: no test in them kills or stops a rank, and a process killed while writing an entry
# would leave it torn (JAX writes in place) and warn in every later process that compiles it.
# Its size limit turns on JAX's file lock (the filelock package): no rank reads a half-written
# entry. Programs that compile in under 0.1 s (eager operations) are not worth an entry.
jax_cache=$PWD/out/jax-cache
rm -rf "$jax_cache"

summary() {  # the counts in pytest's closing line of log $1
    grep -aE "[0-9]+ (passed|failed|errors?|skipped).* in [0-9.]+s" "$1" | tail -n 1
}

# The single-process tests (tests/unit, tests/launcher: the launcher tests start mpirun jobs,
# and the main job, preemption, Slurm template and example tests launch whole training jobs)
# in two pytest workers (pytest-xdist): one at a time they left a core idle 30-40% of the time
# (1-rank jobs, start-ups, tests that wait on a stopped rank's timeout); two side by side took
# 850 s instead of 1070 s. Each worker starts on one half of the list (the launcher tests first,
# then the unit tests) and takes tests from the other's queue when its own runs out
# (--dist worksteal), so the many short unit tests fill in the gaps. Each test has its own
# tmp_path and its own jobs; a module's fixtures may be built once in each worker.
echo "=== single-process tests (launcher with the main job, preemption, Slurm templates and examples; unit), two workers; then GPU tests, which skip without a GPU"
timeout --kill-after=15 1800 "$PY" -m pytest -q --color=no -p no:cacheprovider --durations=20 --timeout=300 --timeout-method=thread \
    -n 2 --dist worksteal tests/launcher tests/unit 2>&1 | tee "$logs/single.log" || failed_runs="$failed_runs single"

# GPU tests: on a machine without CuPy and a GPU each one is skipped, with the reason shown
# (a pytest run of its own: tests/launcher imports its conftest by name).
timeout --kill-after=15 300 "$PY" -m pytest -q -rs --color=no -p no:cacheprovider --timeout=120 \
    tests/gpu 2>&1 | tee "$logs/gpu.log" || failed_runs="$failed_runs gpu"

# ranks_run NAME N TESTS [mpirun limit] [pytest timeout]: one multi-rank pytest run; on
# failure the logs of ranks > 0 are shown. [Gloo] lines are JAX's connection chatter.
ranks_run() {
    local name=$1 n=$2 tests=$3 limit=${4:-900} timeout=${5:-120}
    JAX_COMPILATION_CACHE_DIR=$jax_cache JAX_COMPILATION_CACHE_MAX_SIZE=$((4 << 30)) \
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.1 \
    scripts/mpirun --limit "$limit" -n "$n" "$PY" scripts/rank_pytest.py "$logs/$name" \
        -q --color=no -p no:cacheprovider --durations=12 --timeout="$timeout" --timeout-method=thread $tests 2>&1 \
        | grep -av '^\[Gloo\]' | tee "$logs/$name.rank0.log"
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        failed_runs="$failed_runs $name"
        for f in "$logs"/$name.rank*.log; do
            [ "$f" = "$logs/$name.rank0.log" ] && continue
            echo "--- $f (last 60 lines)"; tail -n 60 "$f"
        done
    fi
}

# tests/mpi/test_reproducible.py writes the digest of a deterministic sum of one global
# batch at each width; they must all be the same bits.
export MPISTRAT_REPRO_DIR=$PWD/$logs/reproducible
# MPICH's set-up (the first time it builds mpi4py and h5py against MPICH) and its singleton tests
# (tests/unit) each use one core, as the 1-rank run does: they run beside it, in the background,
# and their output is shown when it ends. $logs/mpich-first.status: 0, or which part failed.
mpich_first() {
    bash scripts/setup.sh --mpi mpich > "$logs/mpich-setup.log" 2>&1 || { echo setup > "$logs/mpich-first.status"; return; }
    MPISTRAT_MPI=mpich timeout --kill-after=15 300 "$PWD/.venv-mpich/bin/python" -m pytest -q --color=no \
        -p no:cacheprovider --timeout=120 --timeout-method=thread tests/unit > "$logs/mpich-single.log" 2>&1 \
        || { echo single > "$logs/mpich-first.status"; return; }
    echo 0 > "$logs/mpich-first.status"
}
mpich_first &
mpich_first_pid=$!
trap 'kill "$mpich_first_pid" 2>/dev/null || true' EXIT
echo "=== multi-rank tests at 1 ranks (beside MPICH's set-up and singleton tests)"
ranks_run np1 1 tests/mpi
wait "$mpich_first_pid"
for n in 2 3 4; do
    echo "=== multi-rank tests at $n ranks"
    ranks_run "np$n" "$n" tests/mpi
done
# tests/mpi/test_data_global.py writes a digest of every global batch of each pipeline at each
# width under $MPISTRAT_REPRO_DIR/data: the sequence must be the same bits at 1, 2, 3 and 4 ranks.
for f in "$MPISTRAT_REPRO_DIR"/data/*.np1.sha256; do
    [ -e "$f" ] || { echo "no global-batch digests were written"; failed_runs="$failed_runs data-digests"; break; }
    base=${f%.np1.sha256}
    if [ "$(ls "$base".np[1-4].sha256 2>/dev/null | wc -l)" -ne 4 ] || \
       [ "$(cat "$base".np[1-4].sha256 | sort -u | wc -l)" -ne 1 ]; then
        echo "global batches differ between widths: $base"; failed_runs="$failed_runs data-digests"
    fi
done

# tests/mpi with JAX CPU arrays as the replicas' values (MPISTRAT_TEST_ARRAYS, tests/mpi/conftest.py);
# tests that are NumPy only skip with their reason; the reproducible digest must stay the same.
echo "=== multi-rank tests at 2 ranks with JAX arrays"
MPISTRAT_TEST_ARRAYS=jax ranks_run "jax2" 2 tests/mpi 600 120
digests=$(cat "$MPISTRAT_REPRO_DIR"/*.np[1-4].sha256 2>/dev/null | sort | uniq -c)
echo "=== reproducible sums across 1-4 ranks:"; echo "$digests"
if [ "$(ls "$MPISTRAT_REPRO_DIR"/*.np[1-4].sha256 2>/dev/null | wc -l)" -ne 4 ] \
        || [ "$(wc -l <<<"$digests")" -ne 1 ]; then
    echo "reproducible sums differ between rank counts (or a run wrote no digest)"
    failed_runs="$failed_runs reproducible"
fi

# Simulated multi-node layouts (MPISTRAT_RANKS_PER_NODE): the hierarchical all-reduce chosen by
# topology at 2 nodes x 2 ranks, 3 nodes x 1 rank, and nodes of 3 + 1 ranks.
for spec in "2 4 nodes2x2" "1 3 nodes3x1" "3 4 nodes3+1"; do
    set -- $spec
    echo "=== hierarchical tests on simulated nodes: $3"
    MPISTRAT_RANKS_PER_NODE=$1 ranks_run "$3" "$2" "tests/mpi/test_hierarchical.py tests/mpi/test_staged_backend.py tests/mpi/test_schedule_tie.py" 300 120
done

# TPUStrategy through the JAX bridge: every rank a JAX host with 4 virtual CPU devices.
for n in 1 2; do
    echo "=== TPUStrategy tests at $n ranks x 4 JAX CPU devices"
    XLA_FLAGS=--xla_force_host_platform_device_count=4 ranks_run "tpu$n" "$n" tests/tpu 600 180
done

# The second MPI: MPICH (Debian's 4.0, its Hydra mpiexec, mpi4py and parallel h5py built against
# it in .venv-mpich by scripts/setup.sh --mpi mpich). Single-process tests start MPICH singletons;
# the doctor, health, settings and main-job launcher tests and the multi-rank tests at 2 and 3
# ranks (checkpoints included) run under its mpiexec (scripts/mpirun with MPISTRAT_MPI=mpich).
echo "=== MPICH: set-up (.venv-mpich) and singleton tests (run beside the 1-rank run), launcher tests in two workers, multi-rank tests at 2 and 3 ranks"
cat "$logs/mpich-setup.log"; cat "$logs/mpich-single.log" 2>/dev/null
mpich_first=$(cat "$logs/mpich-first.status" 2>/dev/null || echo setup)
if [ "$mpich_first" != setup ]; then
    [ "$mpich_first" = 0 ] || failed_runs="$failed_runs mpich-single"
    (
        export MPISTRAT_MPI=mpich
        PY=$PWD/.venv-mpich/bin/python
        timeout --kill-after=15 600 "$PY" -m pytest -q --color=no -p no:cacheprovider --timeout=300 \
            --timeout-method=thread -n 2 --dist worksteal tests/launcher/test_train_job.py \
            tests/launcher/test_checkpoint_signals.py tests/launcher/test_health_strangers.py \
            tests/launcher/test_health_jobs.py tests/launcher/test_settings_jobs.py \
            tests/launcher/test_info.py -k "not same_global_batch" 2>&1 \
            | grep -av '^\[Gloo\]' | tee "$logs/mpich-jobs.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    ) || failed_runs="$failed_runs mpich-jobs"
    # The reproducible sums and global batches must be the same bits under both MPIs.
    export MPISTRAT_MPI=mpich MPISTRAT_REPRO_DIR=$PWD/$logs/reproducible-mpich
    PY_OPENMPI=$PY; PY=$PWD/.venv-mpich/bin/python
    # At 3 ranks MPICH leaves out the Keras and Horovod-Keras files: framework code over the
    # collectives that the other files run there (Open MPI runs them at 1-3 ranks, MPICH at 2),
    # and most of the stage's time.
    FRAMEWORK_ONLY="--ignore-glob=tests/mpi/test_*keras* --ignore=tests/mpi/test_horovod_loops.py
                    --ignore=tests/mpi/test_horovod_api.py --ignore=tests/mpi/test_horovod_messages.py"
    ranks_run "mpich-np2" 2 tests/mpi 600 120
    ranks_run "mpich-np3" 3 "tests/mpi $FRAMEWORK_ONLY" 600 120
    PY=$PY_OPENMPI; unset MPISTRAT_MPI; export MPISTRAT_REPRO_DIR=$PWD/$logs/reproducible
    for f in "$logs"/reproducible/*.np[23].sha256 "$logs"/reproducible/data/*.np[23].sha256; do
        [ -e "$f" ] || { echo "Open MPI wrote no digest"; failed_runs="$failed_runs mpich-digests"; break; }
        mpich=${f/reproducible/reproducible-mpich}
        cmp -s "$f" "$mpich" || { echo "MPICH and Open MPI differ (or MPICH wrote none): $mpich"
                                  failed_runs="$failed_runs mpich-digests"; }
    done
else
    failed_runs="$failed_runs mpich-setup"
fi

# Several real hosts on this machine (scripts/cluster: head + node1..3 built from Linux
# namespaces, Open MPI over an rsh agent, Slurm with one slurmd per node). The session fixture
# brings one cluster up and down; the trap takes it down whatever happens. Where namespaces
# are refused, these tests skip with the reason. tests/mpi and tests/tpu also run across the
# hosts (test_conformance.py); their rank-0 logs land in $logs as cluster-*.rank0.log.
echo "=== multi-host tests (namespace cluster: mpirun over the agent, srun --mpi=pmix, sbatch)"
trap 'scripts/cluster down >/dev/null 2>&1 || true' EXIT
MPISTRAT_TEST_LOGS=$PWD/$logs timeout --kill-after=15 1200 "$PY" -m pytest -q --color=no \
    -p no:cacheprovider --durations=12 --timeout=600 --timeout-method=thread -rxXs tests/cluster 2>&1 \
    | grep -av '^\[Gloo\]' | tee "$logs/cluster.log" || failed_runs="$failed_runs cluster"
scripts/cluster down >/dev/null 2>&1 || true

passed=0; failed=0; skipped=0
for f in "$logs/single.log" "$logs/gpu.log" "$logs"/np?.rank0.log "$logs"/jax?.rank0.log \
         "$logs"/nodes*.rank0.log "$logs"/tpu?.rank0.log "$logs/cluster.log" \
         "$logs/mpich-single.log" "$logs/mpich-jobs.log" "$logs"/mpich-np?.rank0.log \
         "$logs"/cluster-*.rank0.log; do
    [ -f "$f" ] || continue
    line=$(summary "$f")
    p=$(grep -oE "[0-9]+ passed" <<<"$line" | grep -oE "[0-9]+" || true)
    x=$(grep -oE "[0-9]+ (failed|errors?)" <<<"$line" | awk '{s += $1} END {print s + 0}')
    s=$(grep -oE "[0-9]+ skipped" <<<"$line" | grep -oE "[0-9]+" || true)
    passed=$((passed + ${p:-0})); failed=$((failed + ${x:-0})); skipped=$((skipped + ${s:-0}))
done
if [ -n "$failed_runs" ] && [ "$failed" -eq 0 ]; then failed=1; fi
hosts_line=$(summary "$logs/cluster.log")
inner=0
for f in "$logs"/cluster-*.rank0.log; do
    [ -f "$f" ] || continue
    p=$(summary "$f" | grep -oE "[0-9]+ passed" | grep -oE "[0-9]+" || true)
    inner=$((inner + ${p:-0}))
done
echo "multi-host tests: ${hosts_line:-none ran}; cases of tests/mpi and tests/tpu passed across hosts: $inner"
echo "runs that failed:${failed_runs:- none}"
echo "mpistrat: $passed passed, $failed failed, $skipped skipped"
[ -z "$failed_runs" ]
