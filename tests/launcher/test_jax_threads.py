"""JAX's CPU thread pool on a process bound to one core (runtime/jax_threads.py, issue 44):
``import mpistrat`` before JAX starts gives the pool two threads (a jitted step whose host
callback all-reduces could otherwise wait forever for a copy queued behind itself); JAX
started first makes the first traced aggregation raise FailedPreconditionError by name,
and a user's own NPROC is kept."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("jax")

# Prints NPROC as this process sees it, then the number of this process's threads once
# JAX's CPU backend has started (its pools grow with the count it was given).
PROGRAM = """
import os, sys
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})   # one core, as mpirun binds
order = sys.argv[1]
if order.startswith("jax-first"):
    import jax
    jax.numpy.ones(1).block_until_ready()
import mpistrat as ms
if order == "jax-first-then-nproc":
    os.environ["NPROC"] = "2"                # too late: JAX's pool has started
import jax
jax.numpy.ones(1).block_until_ready()
print("NPROC", os.environ.get("NPROC"), "threads", len(os.listdir("/proc/self/task")))
strategy = ms.MultiWorkerMirroredStrategy()
try:
    out = jax.jit(lambda g: ms.nn.all_reduce_gradients(g, strategy))(jax.numpy.ones(3))
    print("reduced", [float(x) for x in out])
except ms.errors.FailedPreconditionError as err:
    print("refused", err)
"""


def run(order, nproc=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_")) and k != "NPROC"}
    env["PYTHONPATH"] = str(ROOT)
    if nproc is not None:
        env["NPROC"] = nproc
    done = subprocess.run([sys.executable, "-c", PROGRAM, order], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout
    line = next(l for l in done.stdout.splitlines() if l.startswith("NPROC "))
    words = line.split()
    return words[1], int(words[3]), done.stdout


def test_mpistrat_first_gives_a_one_core_process_two_pool_threads_and_the_step_runs():
    nproc, threads, out = run("mpistrat-first")
    assert nproc == "2", out
    _, one_thread, _ = run("mpistrat-first", nproc="1")   # the user's own count is kept
    assert threads > one_thread, (threads, one_thread)    # the pool did grow
    assert "reduced [1.0, 1.0, 1.0]" in out, out


def test_jax_started_first_on_one_core_is_refused_by_name_at_the_traced_aggregation():
    nproc, _, out = run("jax-first")
    assert nproc == "None", out
    assert "refused" in out and "JAX's CPU backend started with one thread" in out, out
    assert "NPROC=2" in out and "reduced" not in out, out


def test_nproc_set_after_jax_started_does_not_silence_the_refusal():
    nproc, _, out = run("jax-first-then-nproc")
    assert nproc == "2", out
    assert "refused rank 0 (host" in out and "started with one thread" in out, out


def test_a_users_nproc_is_never_overridden_nor_refused():
    nproc, _, out = run("jax-first", nproc="3")
    assert nproc == "3", out
    assert "reduced [1.0, 1.0, 1.0]" in out, out
