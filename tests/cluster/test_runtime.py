"""The runtime and the strategies see real hosts (mpirun over the agent, and srun)."""

import json
import sys

import pytest

from .conftest import LAUNCHERS, LAYOUTS, expected_host, parse_layout

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_info_reports_the_real_hosts(cluster, tmp_path, launcher, layout):
    result = cluster.launch(launcher, layout,
                            [sys.executable, "-m", "mpistrat", "info", "--json"],
                            cwd=tmp_path)
    assert result.returncode == 0, result
    rows = json.loads(result.output[result.output.index("{"):])["ranks"]
    hosts, per_host = parse_layout(layout)
    assert [row["rank"] for row in rows] == list(range(hosts * per_host)), result
    for row in rows:
        assert row["host"] == expected_host(row["rank"], layout), row
        assert row["nodes"] == hosts, row
        assert row["node"] == row["rank"] // per_host, row
        assert row["local_rank"] == row["rank"] % per_host, row
        assert row["local_size"] == per_host, row


JOB_TOPOLOGY = """
import json, socket
import numpy as np
import mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
assert not world.simulated_nodes
node_hosts = world.node_comm.allgather(socket.gethostname())
try:
    ms.MirroredStrategy()
    refused = None
except ValueError as err:
    refused = str(err)
strategy = ms.MultiWorkerMirroredStrategy()
total = strategy.reduce("SUM", np.array([world.rank + 1.0, 1.0]), axis=None)
hosts = strategy.gather(np.array([world.node_index]), axis=0)
say(json.dumps({"rank": world.rank, "host": socket.gethostname(), "node_hosts": node_hosts,
                "refused": refused, "replicas": strategy.num_replicas_in_sync,
                "total": total.tolist(), "node_of_replica": hosts.tolist(),
                "spec": ms.cluster_resolver.MPIClusterResolver().cluster_spec().as_dict()}))
"""


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_node_comm_and_strategies_across_hosts(job, launcher, layout):
    result = job(launcher, layout, JOB_TOPOLOGY)
    assert result.returncode == 0, result
    hosts, per_host = parse_layout(layout)
    size = hosts * per_host
    rows = sorted(result.rows(), key=lambda row: row["rank"])
    assert len(rows) == size, result
    for row in rows:
        host = expected_host(row["rank"], layout)
        # COMM_TYPE_SHARED groups exactly the ranks of this host.
        assert row["node_hosts"] == [host] * per_host, row
        assert "MirroredStrategy spans the ranks of one node" in row["refused"], row
        assert f"{hosts} nodes" in row["refused"], row
        assert "MultiWorkerMirroredStrategy" in row["refused"], row
        assert row["replicas"] == size, row
        assert row["total"] == [size * (size + 1) / 2, size], row
        assert row["node_of_replica"] == [r // per_host for r in range(size)], row
        assert row["spec"]["worker"] == [f"{expected_host(r, layout)}:{r}" for r in range(size)]


JOB_SLURM_RESOLVER = """
import json, os
import mpistrat as ms
from mpistrat.runtime import get_world
resolver = ms.cluster_resolver.SlurmClusterResolver()
resolver.check_matches_world(get_world())
strategy = ms.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
say(json.dumps({"rank": get_world().rank, "task_id": resolver.task_id, "nodes": resolver.nodes,
                "tasks_per_node": resolver.tasks_per_node,
                "workers": resolver.cluster_spec().job_tasks("worker"),
                "master": resolver.master(), "replicas": strategy.num_replicas_in_sync,
                "nodelist": os.environ["SLURM_JOB_NODELIST"]}))
"""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slurm_cluster_resolver_reads_the_real_allocation(job, layout):
    result = job("srun", layout, JOB_SLURM_RESOLVER)
    assert result.returncode == 0, result
    hosts, per_host = parse_layout(layout)
    nodes = [f"node{i + 1}" for i in range(hosts)]
    rows = sorted(result.rows(), key=lambda row: row["rank"])
    assert len(rows) == hosts * per_host, result
    for row in rows:
        assert row["task_id"] == row["rank"], row
        assert row["nodelist"] == f"node[1-{hosts}]", row
        assert row["nodes"] == nodes, row
        assert row["tasks_per_node"] == [per_host] * hosts, row
        assert row["workers"] == [f"{n}:{8888 + i}" for n in nodes for i in range(per_host)], row
        assert row["master"] == "mpi://node1:8888", row
        assert row["replicas"] == hosts * per_host, row
