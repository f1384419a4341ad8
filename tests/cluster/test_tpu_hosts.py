"""TPUStrategy across 2 hosts, each a JAX host with 4 virtual CPU devices; JAX's coordinator
runs on rank 0 and the other host reaches it by host name, as in multi-node production."""

import pytest

from .conftest import LAUNCHERS

pytestmark = pytest.mark.timeout(240)

DEVICES = 4

JOB_TPU = """
import json
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
strategy = ms.TPUStrategy(ms.cluster_resolver.TPUClusterResolver(tpu=""))
import jax.numpy as jnp
from jax._src import distributed
world = get_world()

def step():
    ctx = ms.get_replica_context()
    i = ctx.replica_id_in_sync_group * 1.0   # a traced value under jit(shard_map)
    return ctx.all_reduce("SUM", i), i

summed, ids = strategy.run(step)
gathered = strategy.gather(strategy.run(
    lambda: jnp.reshape(ms.get_replica_context().replica_id_in_sync_group, (1,))), axis=0)
say(json.dumps({
    "rank": world.rank, "host": world.hostname, "nodes": world.num_nodes,
    "coordinator": distributed.global_state.coordinator_address,
    "replicas": strategy.num_replicas_in_sync,
    "local_ids": list(strategy.extended.local_replica_ids),
    "all_reduce": [float(x) for x in strategy.experimental_local_results(summed)],
    "reduce": float(strategy.reduce("SUM", ids, axis=None)),
    "gather": np.asarray(gathered).ravel().tolist()}))
"""


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tpu_strategy_spans_two_jax_hosts_reached_by_name(job, launcher):
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    result = job(launcher, "2x1", JOB_TPU, limit=150, env=env)
    assert result.returncode == 0, result
    rows = sorted(result.rows(), key=lambda row: row["rank"])
    assert [row["host"] for row in rows] == ["node1", "node2"], result
    n = 2 * DEVICES
    for row in rows:
        assert row["nodes"] == 2, row
        # The coordinator is on rank 0's host, named, not a loopback address.
        assert row["coordinator"].startswith("node1:"), row
        assert row["replicas"] == n, row
        first = row["rank"] * DEVICES
        assert row["local_ids"] == list(range(first, first + DEVICES)), row
        assert row["all_reduce"] == [n * (n - 1) / 2] * DEVICES, row
        assert row["reduce"] == n * (n - 1) / 2, row
        assert row["gather"] == list(range(n)), row
