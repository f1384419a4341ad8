"""Cluster resolvers: who the workers are, from MPI or from Slurm.

    >>> from mpistrat.cluster_resolver import expand_hostlist, expand_tasks_per_node
    >>> expand_hostlist("gpu[01-03,7],login")
    ['gpu01', 'gpu02', 'gpu03', 'gpu7', 'login']
    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
"""

import os
import re
from typing import Dict, List, Optional

from mpistrat.cluster_spec import ClusterSpec

__all__ = ["ClusterSpec", "ClusterResolver", "MPIClusterResolver", "SlurmClusterResolver",
           "TPUClusterResolver", "expand_hostlist", "expand_tasks_per_node"]


class ClusterResolver:
    """Base class: ``cluster_spec()``, ``task_type``, ``task_id``, ``master()``."""

    task_type = "worker"
    rpc_layer = "mpi"
    environment = ""

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    @property
    def task_id(self) -> int:
        raise NotImplementedError

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The address of a task (default: worker 0), prefixed with the rpc layer."""
        tasks = self.cluster_spec().job_tasks(task_type or "worker")
        address = tasks[task_id or 0]
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> Dict[str, int]:
        """Accelerators per worker; CPU replicas report none."""
        return {}

    def check_matches_world(self, world) -> None:
        """Raise ``ValueError`` if the resolver's cluster is not the MPI job's."""
        workers = self.cluster_spec().num_tasks("worker")
        if workers != world.size or self.task_id != world.rank:
            raise ValueError(
                f"{type(self).__name__} describes {workers} workers with this one as task "
                f"{self.task_id}, but MPI runs {world.size} ranks with this one as rank "
                f"{world.rank}; launch one MPI rank per worker (srun -n {workers} or "
                f"mpirun -n {workers})")


class MPIClusterResolver(ClusterResolver):
    """Workers are the ranks of the MPI job; task id is the rank.

    >>> from mpistrat.cluster_resolver import MPIClusterResolver
    >>> MPIClusterResolver().task_type
    'worker'
    """

    environment = "mpi"

    def __init__(self):
        self._spec: Optional[ClusterSpec] = None

    @property
    def task_id(self) -> int:
        from mpistrat.runtime import get_world
        return get_world().rank

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": ["host:rank", ...]}`` (collective on first call)."""
        if self._spec is None:
            from mpistrat.runtime import get_world
            world = get_world()
            hosts = world.comm.allgather(world.hostname)
            self._spec = ClusterSpec({"worker": [f"{h}:{r}" for r, h in enumerate(hosts)]})
        return self._spec

    def check_matches_world(self, world) -> None:
        return None  # built from the MPI job itself


def expand_hostlist(hostlist: str) -> List[str]:
    """Expand a Slurm host list such as ``node[01-03,7],gpu5`` (pure)."""
    hosts: List[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", hostlist):
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            last = last or first
            width = len(first)
            for number in range(int(first), int(last) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    return hosts


def expand_tasks_per_node(text: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` into ``[2, 2, 2, 1]`` (pure)."""
    counts: List[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot parse tasks per node {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SlurmClusterResolver(ClusterResolver):
    """Workers from the Slurm step's environment (``srun``): one task per rank.

    ``port_base`` only labels addresses; MPI does the communication.
    """

    environment = "slurm"

    def __init__(self, jobs=None, port_base: int = 8888, gpus_per_node=None, gpus_per_task=None,
                 tasks_per_node=None, auto_set_gpu=True, rpc_layer="mpi"):
        if "SLURM_PROCID" not in os.environ:
            raise ValueError("SlurmClusterResolver needs a Slurm step (SLURM_PROCID is not set); "
                             "launch with srun, or use MPIClusterResolver under mpirun")
        self.port_base = port_base
        self.rpc_layer = rpc_layer
        self.gpus_per_task = gpus_per_task
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        self.nodes = expand_hostlist(nodelist)
        per_node_text = (os.environ.get("SLURM_STEP_TASKS_PER_NODE")
                         or os.environ.get("SLURM_TASKS_PER_NODE") or "1")
        self.tasks_per_node = ([int(tasks_per_node)] * len(self.nodes) if tasks_per_node
                               else expand_tasks_per_node(per_node_text))
        self._task_id = int(os.environ["SLURM_PROCID"])

    @property
    def task_id(self) -> int:
        return self._task_id

    def cluster_spec(self) -> ClusterSpec:
        """One entry per Slurm task, on the node it runs on (block distribution)."""
        tasks = []
        for node, count in zip(self.nodes, self.tasks_per_node):
            tasks.extend(f"{node}:{self.port_base + i}" for i in range(count))
        return ClusterSpec({"worker": tasks})


class TPUClusterResolver(MPIClusterResolver):
    """The JAX hosts of this MPI job, one per rank (``tpu=''``: this job's own devices).

    Upstream, ``tpu`` names a TPU to connect to over gRPC; here the hosts are
    the ranks that ``mpirun``/``srun`` started, so only ``''``, ``'local'`` or
    ``None`` make sense::

        >>> from mpistrat.cluster_resolver import TPUClusterResolver
        >>> TPUClusterResolver(tpu='').environment
        'jax'
    """

    environment = "jax"

    def __init__(self, tpu=None, zone=None, project=None, job_name="worker",
                 coordinator_name=None, coordinator_address=None, credentials="default",
                 service=None, discovery_url=None):
        if tpu not in (None, "", "local"):
            raise ValueError(
                f"TPUClusterResolver(tpu={tpu!r}): mpistrat finds its hosts from MPI, one rank "
                f"per host; pass tpu='' and launch the job with mpirun or srun")
        super().__init__()
        self.tpu = tpu or ""
        self.task_type = job_name
        self.coordinator_address = coordinator_address

    def cluster_spec(self) -> ClusterSpec:
        """``{job_name: ["host:rank", ...]}`` (collective on first call)."""
        return ClusterSpec({self.task_type: super().cluster_spec().job_tasks("worker")})

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> Dict[str, int]:
        """Devices per host by platform, e.g. ``{"TPU": 4}`` (starts the JAX bridge)."""
        from mpistrat.runtime import jax_bridge
        topology = jax_bridge.topology()
        return {topology.platform.upper(): topology.num_devices_per_task}

    def get_tpu_system_metadata(self):
        """The topology of the JAX hosts (starts the JAX bridge)."""
        from mpistrat.runtime import jax_bridge
        return jax_bridge.topology()
