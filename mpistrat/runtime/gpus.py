"""Which GPU a rank uses, chosen before any CUDA work, and the devices a job sees.

One rank drives one GPU. The choice is a pure function of the local rank,
the number of visible GPUs and the environment, so it is tested without a
GPU; ``bind_device`` applies it once per process when a strategy is made::

    >>> from mpistrat.runtime.gpus import choose_gpu, device_for_rank
    >>> choose_gpu(local_rank=5, num_visible=4, env={}).index
    1
    >>> choose_gpu(local_rank=3, num_visible=1, env={"CUDA_VISIBLE_DEVICES": "2"}).reason
    'CUDA_VISIBLE_DEVICES=2 leaves one GPU to this rank (bound by the launcher or Slurm)'
    >>> device_for_rank(["GPU:0", "GPU:1"], local_rank=1, local_size=2, num_visible=2)
    ('GPU', 1)

Slurm's per-task GPU binding (``--gpus-per-task``, ``--gpu-bind``) reaches
the process as a ``CUDA_VISIBLE_DEVICES`` that lists only the task's GPUs,
so it is respected by counting visible GPUs, never physical ones.
"""

import collections
import functools
import os
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from mpistrat.runtime import settings

__all__ = ["GpuChoice", "BoundDevice", "PhysicalDevice", "visible_gpu_ids", "choose_gpu",
           "parse_device", "device_for_rank", "count_gpus", "bind_device", "bound_device",
           "list_physical_devices", "shared_gpu_ranks"]

PhysicalDevice = collections.namedtuple("PhysicalDevice", ["name", "device_type"])
PhysicalDevice.__doc__ = "A device as ``tf.config.list_physical_devices`` names it."


@dataclass(frozen=True)
class GpuChoice:
    """The GPU ordinal (as CUDA numbers the visible GPUs) and why it was chosen."""

    index: int
    reason: str


def visible_gpu_ids(env: Mapping[str, str]) -> Optional[Tuple[str, ...]]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (``None`` when unset; ``()`` hides all GPUs).

    >>> visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "0,3"}), visible_gpu_ids({})
    (('0', '3'), None)
    """
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    ids = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):  # CUDA stops at the first invalid entry
            break
        ids.append(entry)
    return tuple(ids)


def choose_gpu(local_rank: int, num_visible: int, env: Mapping[str, str]) -> GpuChoice:
    """GPU ``local_rank % num_visible`` of the GPUs this process sees.

    When the launcher left exactly one GPU visible (Slurm's per-task binding,
    or a wrapper script), that GPU is the rank's whatever its local rank.
    """
    if num_visible < 1:
        raise ValueError(f"choose_gpu: no GPU is visible to local rank {local_rank}")
    ids = visible_gpu_ids(env)
    if num_visible == 1 and ids is not None:
        return GpuChoice(0, f"CUDA_VISIBLE_DEVICES={','.join(ids)} leaves one GPU to this rank "
                            f"(bound by the launcher or Slurm)")
    index = local_rank % num_visible
    source = f"CUDA_VISIBLE_DEVICES={','.join(ids)}" if ids is not None else "all GPUs visible"
    return GpuChoice(index, f"local rank {local_rank} % {num_visible} visible GPUs ({source})")


def parse_device(name: str) -> Tuple[str, int]:
    """``("GPU", 1)`` for ``"GPU:1"``, ``"/gpu:1"`` or ``"/job:w/replica:0/task:0/device:GPU:1"``.

    >>> parse_device("/device:CPU:0")
    ('CPU', 0)
    """
    text = str(name).split("device:")[-1].strip().lstrip("/").upper()
    kind, _, index = text.partition(":")
    if kind not in ("GPU", "CPU") or not index.isdigit():
        raise ValueError(f"device name {name!r} is not of the form 'GPU:<n>' or 'CPU:<n>'")
    return kind, int(index)


def device_for_rank(devices: Sequence[str], local_rank: int, local_size: int,
                    num_visible: int) -> Tuple[str, int]:
    """The device ``MirroredStrategy(devices=...)`` gives to ``local_rank`` (one per rank).

    Raises ``ValueError`` naming the disagreement: a count that differs from
    the ranks of the node, a GPU named twice, a GPU that is not visible, or
    CPUs mixed with GPUs. (Each rank is its own host process, so ``CPU:0``
    may be named for every rank.)
    """
    parsed = [parse_device(d) for d in devices]
    if len(parsed) != local_size:
        raise ValueError(
            f"MirroredStrategy got {len(parsed)} devices {list(devices)} but {local_size} ranks "
            f"run on this node; mpistrat runs one replica per rank, so launch with "
            f"mpirun -n {len(parsed)} per node (or pass devices=None)")
    if len(set(parsed)) != len(parsed) and any(kind == "GPU" for kind, _ in parsed):
        raise ValueError(f"MirroredStrategy: devices {list(devices)} name a device twice")
    kinds = {kind for kind, _ in parsed}
    if len(kinds) > 1:
        raise ValueError(f"MirroredStrategy: devices {list(devices)} mix CPUs and GPUs; "
                         f"give one kind")
    kind, index = parsed[local_rank]
    if kind == "GPU" and index >= num_visible:
        raise ValueError(
            f"MirroredStrategy: local rank {local_rank} was given {devices[local_rank]!r} but "
            f"this rank sees {num_visible} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return kind, index


def shared_gpu_ranks(keys: Sequence[Optional[Tuple]]) -> Tuple[Tuple[int, ...], ...]:
    """Groups of ranks bound to the same GPU (``keys[r]``: node and GPU of rank r, or None).

    >>> shared_gpu_ranks([(0, "a"), (0, "a"), (1, "a"), None])
    ((0, 1),)
    """
    groups = collections.defaultdict(list)
    for rank, key in enumerate(keys):
        if key is not None:
            groups[key].append(rank)
    return tuple(tuple(ranks) for ranks in groups.values() if len(ranks) > 1)


# -- the machine ---------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def count_gpus() -> int:
    """Visible GPUs: asked of CuPy when installed, else of the CUDA driver; 0 without CUDA.

    ``MPISTRAT_DISABLE_GPU=1`` counts none (host replicas even on a GPU machine).
    """
    if settings.get("MPISTRAT_DISABLE_GPU"):
        return 0
    if visible_gpu_ids(os.environ) == ():
        return 0
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CuPy missing, or no driver: ask the driver itself
        pass
    import ctypes
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except (OSError, AttributeError):
        return 0


def list_physical_devices(device_type: Optional[str] = None):
    """The devices of this process, as ``tf.config.list_physical_devices``.

    >>> list_physical_devices("CPU")
    [PhysicalDevice(name='/physical_device:CPU:0', device_type='CPU')]
    """
    found = [PhysicalDevice("/physical_device:CPU:0", "CPU")]
    found += [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(count_gpus())]
    if device_type is None:
        return found
    return [d for d in found if d.device_type == str(device_type).upper()]


@dataclass(frozen=True)
class BoundDevice:
    """The device this rank's replica lives on."""

    kind: str                 # "GPU" or "CPU"
    index: int
    reason: str
    shared: Tuple[Tuple[int, ...], ...] = ()  # world ranks that share one physical GPU
    key: Optional[Tuple] = None               # (host, PCI bus id): names the GPU across ranks

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"


_BOUND: Optional[BoundDevice] = None
_LOCK = threading.Lock()


def bound_device() -> Optional[BoundDevice]:
    """The device bound by ``bind_device`` (``None`` before any strategy was made)."""
    return _BOUND


def bind_device(world, devices: Optional[Sequence[str]] = None) -> BoundDevice:
    """Bind this rank to its GPU (or host) once; collective over ``world.comm``.

    Must run before any CUDA work of the process. Later calls return the
    first binding, and raise if ``devices`` asks for another device.
    """
    global _BOUND
    with _LOCK:
        if _BOUND is not None and devices is None:
            return _BOUND  # bound once per process (on every rank alike); strategies share it
        error, choice = None, None
        try:
            choice = _choose(world, devices)
            if _BOUND is not None and choice.name != _BOUND.name:
                raise ValueError(f"this process is bound to {_BOUND.name} ({_BOUND.reason}); "
                                 f"a strategy cannot move it to {choice.name}")
        except ValueError as err:
            error = str(err)
        key = None
        if error is None and choice.kind == "GPU" and _BOUND is None:
            # the host, not the (possibly simulated) node: simulated nodes share real GPUs
            key = (world.hostname, _use_gpu(choice.index))
        rows = world.comm.allgather((key, error))  # small metadata, agreed on every rank
        errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(rows) if e]
        if errors:  # raised on every rank together, never on one rank alone
            raise ValueError("device binding failed: " + "; ".join(errors))
        if _BOUND is None:
            _BOUND = BoundDevice(choice.kind, choice.index, choice.reason,
                                 shared_gpu_ranks([k for k, _ in rows]), key)
        return _BOUND


def _choose(world, devices: Optional[Sequence[str]]) -> BoundDevice:
    num_visible = count_gpus()
    if devices is not None:
        kind, index = device_for_rank(devices, world.local_rank, world.local_size, num_visible)
        return BoundDevice(kind, index, f"MirroredStrategy(devices=...) entry "
                                        f"{world.local_rank} of this node")
    if num_visible:
        picked = choose_gpu(world.local_rank, num_visible, os.environ)
        return BoundDevice("GPU", picked.index, picked.reason)
    return BoundDevice("CPU", 0, "no GPU visible: the replica is this host")


def _use_gpu(index: int) -> str:
    """Make GPU ``index`` current for CuPy; its PCI bus id names it across processes."""
    try:
        import cupy
    except ImportError:
        return f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}#{index}"
    device = cupy.cuda.Device(index)
    device.use()
    try:
        return str(device.pci_bus_id)
    except Exception:  # older CuPy: fall back to the ordinal within the visible set
        return f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}#{index}"
