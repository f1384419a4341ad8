"""ms.nn's gradient all-reduce over meshes of several JAX devices per rank, under every CPU binding
(issue 44): tests/mpi/test_jax_meshes.py (optax and Flax NNX steps over a mesh and on one device,
sharded gradients of two meshes, ``shard_map`` and ``pmap`` running the callback once per device
on JAX's threads, the named refusals) run in fresh processes with
``--xla_force_host_platform_device_count``, at 2 and 3 ranks, each rank bound to a core, and the
whole job on one CPU, where JAX's per-device threads and the ranks share that CPU. Ranks whose
programs run on other device counts are refused by name on every rank."""

from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

MESHES = Path(__file__).resolve().parent.parent / "mpi" / "test_jax_meshes.py"

JOB = """
import os, sys
if sys.argv[1] == "one-cpu":   # (launched unbound: every rank sees the same CPUs)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})   # all ranks on one CPU
import pytest
code = pytest.main(["--with-mpi", "-q", "-p", "no:cacheprovider", "--timeout=150", sys.argv[2]])
from mpi4py import MPI
say("rank", MPI.COMM_WORLD.Get_rank(), "exit", int(code), "cpus", sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize("ranks, devices, binding", [
    (2, 4, "default"), (3, 2, "default"), (2, 2, "bind-to-core"), (2, 4, "one-cpu")])
def test_mesh_programs_under_every_binding(launch, ranks, devices, binding):
    mpirun_args = {"bind-to-core": ("--bind-to", "core"),
                   "one-cpu": ("--bind-to", "none")}.get(binding, ())
    done = launch(ranks, JOB, binding, str(MESHES), limit=240, mpirun_args=mpirun_args,
                  env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    assert done.returncode == 0, done
    ends = [line.split(" cpus ")[1] for line in done.output.splitlines()
            if line.startswith("rank ") and " exit 0 cpus " in line]
    assert len(ends) == ranks, done                       # every rank's tests passed
    if binding == "one-cpu":
        assert len(set(ends)) == 1 and "," not in ends[0], done   # one CPU for the whole job
    assert done.output.count("11 passed") == ranks, done   # every test of the file


COUNTS = """
import os
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 + 2 * rank}"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import mpistrat as ms
strategy = ms.MultiWorkerMirroredStrategy()
mesh = Mesh(np.array(jax.local_devices()), ("d",))    # 2 devices on rank 0, 4 on rank 1
step = jax.jit(jax.shard_map(lambda g: ms.nn.all_reduce_gradients(g, strategy), mesh=mesh,
                             in_specs=P("d"), out_specs=P("d")))
try:
    say("rank", rank, "got", np.asarray(step(jnp.ones(len(mesh.devices)))).tolist())
except Exception as err:
    say("rank", rank, "raised", type(err).__name__, str(err).splitlines()[-1])
"""


def test_ranks_whose_meshes_differ_in_devices_are_refused_by_name(launch):
    done = launch(2, COUNTS, limit=120)
    lines = [line for line in done.output.splitlines() if line.startswith("rank ")]
    assert lines and not [line for line in lines if " got " in line], done   # no values
    for line in lines:
        assert " raised " in line and "ranks are in different collectives" in line, done
    # every rank's callback names both counts (JAX raises it in the step, or, when its
    # devices' calls failed before the step was waited on, at the process's exit)
    named = "rank 0 calls all_reduce MEAN (ms.nn, 2 devices per rank); rank 1 calls " \
            "all_reduce MEAN (ms.nn, 4 devices per rank)"
    assert done.output.count(named) >= 2, done
