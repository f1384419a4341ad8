"""What kind of array a value is, what this rank's transport can do, and staging.

CuPy and JAX are optional and imported only when a value of theirs shows up.
The kind of an array is read from its type's module, never by importing::

    >>> import numpy as np
    >>> from mpistrat.runtime.devices import array_kind
    >>> array_kind(np.zeros(3)), array_kind(1.5)
    ('numpy', 'numpy')

Which GPU a rank uses is decided in one place, ``runtime.gpus`` (``choose_gpu``, applied by
``bind_device`` when a strategy is made).
"""

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.runtime import settings

__all__ = ["array_kind", "Capabilities", "capabilities",
           "cuda_aware_mpi", "nccl_available", "cupy_available", "jax_on_gpu", "array_module",
           "as_cupy", "from_cupy_like", "to_host", "from_host"]


def array_kind(value: Any) -> str:
    """``"cupy"``, ``"jax"``, ``"cuda"`` (another library's device array) or ``"numpy"``.

    ``"cuda"`` is any other object exposing ``__cuda_array_interface__`` (a
    Numba or PyTorch CUDA tensor): device memory that must never be handed
    to an MPI that is not CUDA-aware.
    """
    module = type(value).__module__ or ""
    if module.startswith("cupy"):
        return "cupy"
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    if type(value) is not np.ndarray and hasattr(value, "__cuda_array_interface__"):
        return "cuda"
    return "numpy"


@functools.lru_cache(maxsize=None)
def cupy_available() -> bool:
    """Whether CuPy imports and sees a GPU (imported only when first asked)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def jax_on_gpu(value: Any) -> bool:
    """Whether a JAX array lives on a CUDA GPU (so CuPy and NCCL can take it via DLPack)."""
    try:
        return all(d.platform in ("gpu", "cuda") for d in value.devices())
    except Exception:
        return False


def array_module(value: Any):
    """``cupy`` for CuPy arrays, else ``numpy`` (CuPy imported only when a value is CuPy's)."""
    if array_kind(value) == "cupy":
        import cupy
        return cupy
    return np


def as_cupy(value: Any):
    """``value`` as a CuPy array without a copy (DLPack for JAX, the CUDA array interface else)."""
    import cupy
    kind = array_kind(value)
    if kind == "cupy":
        return value
    if kind == "jax":
        return cupy.from_dlpack(value)
    return cupy.asarray(value)


def from_cupy_like(result: Any, like: Any) -> Any:
    """A CuPy result handed back as the kind of ``like`` (JAX through DLPack, no copy)."""
    if array_kind(like) == "jax":
        import jax
        return jax.dlpack.from_dlpack(result)
    return result


@functools.lru_cache(maxsize=None)
def cuda_aware_mpi() -> Tuple[bool, str]:
    """Whether MPI accepts device pointers, and how that was decided.

    ``MPISTRAT_CUDA_AWARE_MPI=0/1`` decides outright; otherwise Open MPI is
    asked through its ``MPIX_Query_cuda_support`` extension. Any other MPI,
    or an Open MPI without the extension, counts as not CUDA-aware: device
    buffers are then staged through host memory.
    """
    forced = settings.get("MPISTRAT_CUDA_AWARE_MPI")
    if forced is not None:
        return forced, f"MPISTRAT_CUDA_AWARE_MPI={int(forced)}"
    version = MPI.Get_library_version()
    if "Open MPI" not in version:
        return False, f"not Open MPI ({version.splitlines()[0][:60]}); no query available"
    for name in ("libmpi.so.40", ctypes.util.find_library("mpi")):
        if not name:
            continue
        try:
            query = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        supported = bool(query())
        return supported, f"MPIX_Query_cuda_support() in {name} returned {int(supported)}"
    return False, "Open MPI without the CUDA extension (MPIX_Query_cuda_support not found)"


@functools.lru_cache(maxsize=None)
def nccl_available() -> Tuple[bool, str]:
    """Whether CuPy's NCCL binding imports (CuPy 14 needs the explicit import).

    ``MPISTRAT_NCCL=0`` turns NCCL off outright (``1`` requires it to import).
    """
    if settings.get("MPISTRAT_NCCL") is False:
        return False, "MPISTRAT_NCCL=0"
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            raise ImportError("CuPy was built without NCCL")
    except Exception as err:  # ImportError, or CUDA missing at import
        return False, f"cupy.cuda.nccl unavailable: {type(err).__name__}: {err}"
    return True, f"cupy.cuda.nccl imported (NCCL {nccl.get_version()})"


@dataclass(frozen=True)
class Capabilities:
    """What the transport of this rank can do with device buffers."""

    cuda_aware_mpi: bool
    nccl: bool
    cupy: bool = False


def capabilities() -> Capabilities:
    """Detect the capabilities once (lazily: nothing is imported for NumPy-only jobs)."""
    return Capabilities(cuda_aware_mpi=cuda_aware_mpi()[0], nccl=nccl_available()[0],
                        cupy=cupy_available())


def to_host(value: Any) -> np.ndarray:
    """Copy a device array into host memory (pinned memory for CuPy)."""
    kind = array_kind(value)
    if kind in ("cupy", "cuda"):
        import cupyx
        value = as_cupy(value)
        host = cupyx.empty_pinned(value.shape, value.dtype)
        value.get(out=host)
        return host
    return np.asarray(value)


def from_host(host: np.ndarray, like: Any) -> Any:
    """Copy ``host`` back to the kind and device of ``like``."""
    kind = array_kind(like)
    if kind == "cuda":
        import cupy
        return cupy.asarray(host)
    if kind == "cupy":
        import cupy
        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(host)
    if kind == "jax":
        import jax
        sharding = getattr(like, "sharding", None)
        if sharding is None or not getattr(like, "committed", True):
            # an uncommitted array lives on the default device, as jnp.asarray's result does,
            # which stays uncommitted too (device_put would commit it), in half the time
            return jax.numpy.asarray(host)
        return jax.device_put(host, sharding)
    return host
