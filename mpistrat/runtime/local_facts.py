"""Facts of this process's machine that ``info`` and ``doctor`` report: package versions,
CuPy's GPUs and JAX's devices (each library started on this rank only, when installed),
and text made printable for a table::

    >>> from mpistrat.runtime.local_facts import printable, package_version
    >>> printable("a\\x00b\\n  c")
    'a b c'
    >>> package_version("no-such-package-here") is None
    True
"""

import os
from typing import Dict, Optional

__all__ = ["package_version", "printable", "gpu_facts", "jax_facts"]


def package_version(package: str) -> Optional[str]:
    """The installed version of ``package``, ``None`` when it is not installed."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def printable(text: str) -> str:
    """Printable text: no NUL bytes or control characters, single spaces."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def gpu_facts() -> Dict:
    """CuPy's view of the GPUs: ``{"cupy": version, "gpus": [names]}`` (empty without CuPy)."""
    if package_version("cupy") is None and not any(package_version(p) for p in ("cupy-cuda12x",
                                                                   "cupy-cuda13x")):
        return {"cupy": None, "gpus": []}
    try:
        import cupy
        names = []
        for index in range(cupy.cuda.runtime.getDeviceCount()):
            name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
            names.append(printable(name.decode() if isinstance(name, bytes) else str(name)))
        return {"cupy": cupy.__version__, "gpus": names}
    except Exception as err:  # CuPy installed, CUDA driver missing
        return {"cupy": f"unusable ({printable(str(err))[:80]})", "gpus": []}


def jax_facts() -> Dict:
    """JAX's local devices (starting JAX on this rank only)."""
    if package_version("jax") is None:
        return {"jax": None, "jax_devices": []}
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        devices = jax.local_devices()
        return {"jax": jax.__version__, "jax_devices": [str(d) for d in devices],
                "jax_platform": devices[0].platform if devices else None}
    except Exception as err:  # a backend that fails to start is a fact too
        return {"jax": package_version("jax"), "jax_devices": [f"error: {printable(str(err))[:80]}"],
                "jax_platform": None}
