"""Gradients aggregated inside ``jax.jit`` (an ordered host callback) and the main thread's own
collectives stay in one stream (collectives/host_callbacks.py), under every CPU binding.

With the step's arrays on two JAX devices, JAX runs the jitted step, and so the callback's
all-reduce, on one of its own threads after the call has returned. Before the stream was kept,
the main thread's ``strategy.reduce`` of a scalar met the other rank's gradient all-reduce of
the same signature: the reduces gave 16 or 17 instead of 30 and the weights ended at -243 and
-255 instead of -60, different on each rank, with no error."""

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

JOB = """
import os, sys
import numpy as np
if sys.argv[1] == "one-cpu":
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})   # taskset to one CPU
import jax, jax.numpy as jnp, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mpistrat as ms

strategy = ms.MultiWorkerMirroredStrategy()
rank, n = ms.runtime.get_world().rank, strategy.num_replicas_in_sync
tx = optax.chain(ms.nn.aggregate_gradients(strategy, "SUM"), optax.sgd(1.0))
params = {"w": jnp.zeros((), jnp.float32)}
state = tx.init(params)
mesh = Mesh(np.array(jax.devices()), ("d",))          # the step's work over both devices
big = jax.device_put(jnp.ones((400, 400), jnp.float32) / 400, NamedSharding(mesh, P("d")))

@jax.jit
def step(params, state, x, big):
    def loss(p):
        return jnp.sum(p["w"] * x[0]) + 0.0 * jnp.sum(jnp.tanh(big @ big.T))
    value, grads = jax.value_and_grad(loss)(params)   # d loss / dw = x = rank + 1
    updates, state = tx.update(grads, state, params)  # the SUM over ranks: n (n + 1) / 2
    return optax.apply_updates(params, updates), state, value

reduces = []
for _ in range(20):
    x = jnp.full(2, float(rank + 1), jnp.float32)
    params, state, value = step(params, state, x, big)   # returns before its callback ran
    reduces.append(float(strategy.reduce("SUM", np.float32(6.0 / n), axis=None)))
say("rank", rank, "reduces", sorted(set(reduces)), "w", float(params["w"]),
    "expect", -20 * n * (n + 1) / 2)
"""


def _outcomes(done, n):
    lines = [line.split() for line in done.output.splitlines() if line.startswith("rank ")]
    assert done.returncode == 0 and len(lines) == n, done
    return lines


@pytest.mark.parametrize("binding", ["default", "bind-to-core", "one-cpu"])
def test_jitted_aggregation_and_main_thread_reduce_stay_in_order(launch, binding):
    mpirun_args = ("--bind-to", "core") if binding == "bind-to-core" else ()
    done = launch(2, JOB, binding, limit=120, mpirun_args=mpirun_args,
                  env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    for words in _outcomes(done, 2):
        assert words[3] == "[6.0]", done             # every reduce: 3.0 + 3.0
        assert float(words[5]) == float(words[7]) == -60.0, done   # 20 steps of -(1 + 2)


def test_jitted_aggregation_in_order_at_three_ranks_on_one_cpu(launch):
    done = launch(3, JOB, "one-cpu", limit=120,
                  env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    for words in _outcomes(done, 3):
        assert words[3] == "[6.0]", done
        assert float(words[5]) == float(words[7]) == -120.0, done


HANG = """
import sys, time
import numpy as np
import jax, jax.numpy as jnp, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mpistrat as ms
strategy = ms.MultiWorkerMirroredStrategy()
rank = ms.runtime.get_world().rank
tx = optax.chain(ms.nn.aggregate_gradients(strategy, "SUM"), optax.sgd(1.0))
params = {"w": jnp.zeros((), jnp.float32)}
state = tx.init(params)
mesh = Mesh(np.array(jax.devices()), ("d",))
big = jax.device_put(jnp.ones((64, 64), jnp.float32), NamedSharding(mesh, P("d")))

@jax.jit
def step(params, state, big):
    grads = jax.grad(lambda p: p["w"] * 2.0 + 0.0 * jnp.sum(big))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

params, state = step(params, state, big)
say("rank", rank, "first step", float(params["w"]))
if rank == 1 and sys.argv[1] == "stall":
    time.sleep(600)                    # never joins the next step's gradient all-reduce
if rank == 1 and sys.argv[1] == "exit":
    sys.exit(0)                        # leaves the job instead
params, state = step(params, state, big)
say("unreachable")
"""


@pytest.mark.parametrize("how", ["stall", "exit"])
def test_a_callback_waiting_for_a_rank_that_never_comes_ends_the_job_by_name(launch, how):
    """Inside the host callback the collective still honours the timeout (a stalled rank:
    DeadlineExceededError naming the all-reduce) and the health check (a rank that left:
    UnavailableError naming it and the callback's collective); never a silent hang."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "MPISTRAT_HEALTH_LEAVE_GRACE": "1"}
    if how == "stall":
        env["MPISTRAT_COLLECTIVE_TIMEOUT"] = "5"
    done = launch(2, HANG, how, limit=90, env=env)
    assert done.returncode not in (0, 124), done
    assert "unreachable" not in done.output and "rank 0 first step -4.0" in done.output, done
    if how == "stall":
        assert "DeadlineExceededError: all_reduce SUM" in done.output, done
        assert "on rank 0: another rank did not join it" in done.output, done
    else:
        assert "UnavailableError: rank 1/2" in done.output, done
        assert "left the job" in done.output and "_Aggregation.host" in done.output, done
    assert done.seconds < 60, done
