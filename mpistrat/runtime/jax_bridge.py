"""The JAX bridge: JAX's multi-process runtime bootstrapped from MPI.

Each MPI rank is one JAX process (a TPU host, a GPU host, or a CPU host with
virtual devices). ``initialize`` gives JAX its process id (the rank), the
process count (the size) and a coordinator address chosen on rank 0 and
broadcast over MPI; on CPU it selects JAX's gloo collectives, so XLA
collectives cross processes. Afterwards the replicas are all JAX devices of
all hosts, ordered host by host: replica ``rank * L + i`` is local device
``i`` of rank ``rank`` (``L`` devices per host)::

    >>> from mpistrat.runtime import jax_bridge
    >>> topology = jax_bridge.initialize()              # doctest: +SKIP
    >>> topology.num_tasks, topology.num_devices_per_task   # doctest: +SKIP
    (2, 4)                               # mpirun -n 2, XLA_FLAGS=...device_count=4

JAX must not have been used before: its devices are fixed when its first
backend starts. Errors that one rank meets before JAX starts are agreed over
MPI, so every rank raises them together.
"""

import math
import socket
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from mpistrat.errors import InvalidArgumentError, UnavailableError
from mpistrat.runtime import settings
from mpistrat.runtime.devices import array_kind
from mpistrat.runtime.world import get_world

__all__ = ["Topology", "initialize", "is_initialized", "topology", "mesh", "local_devices",
           "local_replica_range", "shutdown", "AXIS", "coordinator_address", "global_from_local",
           "local_from_global"]

AXIS = "replica"  # the one mesh axis: every device is one replica
_lock = threading.Lock()
_state: dict = {}


@dataclass(frozen=True)
class Topology:
    """The JAX hosts and devices of the job (what ``initialize_tpu_system`` returns)."""

    num_tasks: int
    num_devices_per_task: int
    platform: str           # "tpu", "gpu" or "cpu"
    device_kind: str

    @property
    def num_replicas(self) -> int:
        return self.num_tasks * self.num_devices_per_task


def coordinator_address(host: Optional[str] = None) -> str:
    """A free ``host:port`` on this machine for JAX's coordinator (rank 0 calls it).

    ``MPISTRAT_JAX_COORDINATOR`` (``host:port``) decides outright; otherwise the
    host is ``MPISTRAT_COORDINATOR_HOST``, else ``host`` (the bridge passes the
    loopback address when every rank runs on one node), else this machine's name.
    """
    forced = settings.get("MPISTRAT_JAX_COORDINATOR")
    if forced:
        return forced
    host = settings.get("MPISTRAT_COORDINATOR_HOST") or host or socket.gethostname()
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"{host}:{port}"


def _prepare(rank: int) -> Optional[str]:
    """Import JAX and check it has not started; an error text, or ``None``."""
    try:
        import jax
        from jax._src import xla_bridge
    except Exception as err:  # ImportError, or a broken installation
        return (f"rank {rank}: JAX is not importable ({type(err).__name__}: {err}); install "
                f"the extra: pip install 'mpistrat[jax]'")
    if xla_bridge.backends_are_initialized():
        return (f"rank {rank}: JAX was used before the bridge started (its devices are fixed "
                f"then); call ms.tpu.experimental.initialize_tpu_system() (or create the "
                f"TPUStrategy) before any other JAX call")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as err:
        return f"rank {rank}: cannot select JAX's gloo CPU collectives: {err}"
    return None


def initialize(timeout_seconds: Optional[int] = None) -> Topology:
    """Start JAX's multi-process runtime over the MPI job (collective, idempotent)."""
    with _lock:
        if "topology" in _state:
            return _state["topology"]
        if _state.get("shut_down"):
            raise RuntimeError("JAX's distributed runtime was shut down in this process; it "
                               "cannot start again (start a new job)")
        world = get_world()
        errors = [e for e in world.comm.allgather(_prepare(world.rank)) if e]
        if errors:
            raise InvalidArgumentError("; ".join(errors))
        import jax
        if world.size > 1:
            local = "127.0.0.1" if world.num_nodes == 1 else None  # one node: no name lookup
            address = world.comm.bcast(coordinator_address(local) if world.rank == 0 else None)
            timeout = int(timeout_seconds or math.ceil(settings.get("MPISTRAT_JAX_INIT_TIMEOUT")))
            try:
                jax.distributed.initialize(coordinator_address=address,
                                           num_processes=world.size, process_id=world.rank,
                                           initialization_timeout=timeout)
            except Exception as err:
                raise UnavailableError(
                    f"rank {world.rank}: JAX's distributed runtime did not start with "
                    f"coordinator {address} ({type(err).__name__}: {err}); set "
                    f"MPISTRAT_COORDINATOR_HOST to an address every host can reach") from err
        devices = sorted(jax.local_devices(), key=lambda d: d.id)
        facts = world.comm.allgather((len(devices), devices[0].platform, devices[0].device_kind))
        counts = [n for n, _, _ in facts]
        if len(set(counts)) > 1:
            detail = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise InvalidArgumentError(
                f"every JAX host needs the same number of devices, but they have {detail}; "
                f"give every rank the same XLA_FLAGS / visible accelerators")
        _state["local"] = devices
        _state["topology"] = Topology(world.size, counts[0], facts[0][1], facts[0][2])
        return _state["topology"]


def is_initialized() -> bool:
    """Whether ``initialize`` has run in this process."""
    return "topology" in _state


def topology() -> Topology:
    """The topology, starting the bridge first if needed (collective then)."""
    return _state.get("topology") or initialize()  # no lock once started: run's hot path


def local_devices() -> List[Any]:
    """This host's JAX devices, in local replica order."""
    initialize()
    return list(_state["local"])


def _global_devices() -> List[Any]:
    import jax
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per_task = topology().num_devices_per_task
    for index, device in enumerate(devices):
        if device.process_index != index // per_task:
            raise InvalidArgumentError(
                f"JAX device {device} belongs to process {device.process_index}, but replica "
                f"{index} should be on rank {index // per_task}; JAX's process ids must be the "
                f"MPI ranks (start JAX only through mpistrat)")
    return devices


def mesh() -> Any:
    """The one-axis mesh (``AXIS``) over every device of every host, in replica order."""
    if "mesh" not in _state:
        import numpy as np
        from jax.sharding import Mesh
        _state["mesh"] = Mesh(np.array(_global_devices()), (AXIS,))
    return _state["mesh"]


def local_replica_range() -> Tuple[int, int]:
    """The global replica ids ``[first, last)`` of this host's devices."""
    per_task = topology().num_devices_per_task
    rank = get_world().rank
    return rank * per_task, (rank + 1) * per_task


def shutdown() -> None:
    """Stop JAX's distributed runtime (collective); a later ``initialize`` is refused by JAX."""
    with _lock:
        if "topology" in _state and get_world().size > 1:
            import jax
            jax.distributed.shutdown()
        _state.clear()
        _state["shut_down"] = True


def _replica_sharding() -> Any:
    if "sharding" not in _state:
        from jax.sharding import NamedSharding, PartitionSpec
        _state["sharding"] = NamedSharding(mesh(), PartitionSpec(AXIS))
    return _state["sharding"]


def global_from_local(values: Sequence[Any]) -> Any:
    """One global array over the mesh from this host's values, one per local device.

    Values of rank 1 or more are laid end to end along their first axis
    (global shape ``(replicas * rows, ...)``), so each device's block *is* its
    replica's value and reading it back costs no XLA operation; scalars are
    stacked into ``(replicas,)``. Every host calls this with values of the
    same shape and dtype (JAX requires one global shape).
    """
    import jax
    import numpy as np
    sharding = _replica_sharding()
    replicas = topology().num_replicas
    shape = tuple(np.shape(values[0]))
    global_shape = (replicas,) if not shape else (replicas * shape[0],) + shape[1:]
    if not any(array_kind(v) == "jax" for v in values):
        host = [np.asarray(v) for v in values]
        big = len(host) * host[0].nbytes >= 1 << 20  # below 1 MiB a copy is cheaper than checks
        data = np.stack(host) if not shape else _adjacent_rows(host) if big else None
        if data is None:
            data = np.concatenate(host)
        return jax.make_array_from_process_local_data(sharding, data, global_shape)
    parts = [jax.device_put(jax.numpy.asarray(v).reshape((1,) + shape if not shape else shape),
                            d) for v, d in zip(values, _state["local"])]
    return jax.make_array_from_single_device_arrays(global_shape, sharding, parts)


def _adjacent_rows(parts: List[Any]) -> Any:
    """The one array that ``parts`` are consecutive row blocks of, or ``None``.

    Batches cut by ``ms.data`` are views of one rank batch; handing JAX that
    batch itself spares a copy (the result aliases the parts' memory).
    """
    import numpy as np
    base, first = parts[0].base, parts[0]
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
        return None
    start = first.__array_interface__["data"][0]
    for i, part in enumerate(parts):
        if (part.base is not base or not part.flags.c_contiguous or part.shape != first.shape
                or part.dtype != first.dtype
                or part.__array_interface__["data"][0] != start + i * first.nbytes):
            return None
    offset = start - base.__array_interface__["data"][0]
    return np.ndarray((len(parts) * first.shape[0],) + first.shape[1:], first.dtype,
                      buffer=base, offset=offset)


def local_from_global(array: Any, scalar: bool = False) -> List[Any]:
    """This host's values of a global array made by ``global_from_local``, in local order.

    ``scalar``: the values are scalars (they come back as NumPy scalars,
    copied to the host: reshaping on the devices would cost an XLA dispatch each).
    """
    import numpy as np
    order = _state.get("order")
    if order is None:
        order = _state["order"] = {d: i for i, d in enumerate(_state["local"])}
    parts: List[Any] = [None] * len(order)
    for shard in array.addressable_shards:
        parts[order[shard.device]] = np.asarray(shard.data)[0] if scalar else shard.data
    return parts
