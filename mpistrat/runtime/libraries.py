"""Which MPI a shared library is linked to, read with ``ldd`` and never loaded: an h5py
built for another MPI than the one running (pip's cache hands one environment's build to
another) crashes inside libhdf5 as soon as it is imported beside this MPI, so
``python -m mpistrat doctor`` asks before anything imports h5py (``foreign_h5py``, called
from the package's ``__init__`` in doctor mode)::

    >>> mpi_family("libmpi.so.40"), mpi_family("libmpich.so.12"), mpi_family("libm.so.6")
    ('Open MPI', 'MPICH', None)
"""

import glob
import os
from typing import Optional, Tuple

__all__ = ["mpi_family", "linked_mpi", "foreign_h5py", "refuse_doctor"]

FIX = ("rebuild it in this environment against this MPI without pip's cache (docs/install.md, "
       "steps 3 and 4: --no-cache-dir --force-reinstall --no-binary=h5py); pip's cache hands "
       "one MPI's build to another environment")


def mpi_family(name: str) -> Optional[str]:
    """The MPI family a shared library's file name belongs to (pure; ``libmpi.so.12`` is
    Intel MPI's, of MPICH's ABI; Cray's is ``libmpi_cray``)."""
    base = os.path.basename(name)
    if base.startswith(("libmpich", "libmpi_cray", "libmpi.so.12")):
        return "MPICH"
    if base.startswith("libmpi.so"):
        return "Open MPI"
    return None


def linked_mpi(package: str, pattern: str) -> Tuple[Optional[str], str]:
    """The MPI family that ``package``'s extension modules (``pattern``) are linked to, and
    the library that says so, read with ``ldd`` without importing the package; ``(None,
    why)`` when none is (a serial build) or it cannot be read."""
    import importlib.util
    import subprocess
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, f"{package} is not installed"
    files = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], pattern)))
    if not files:
        return None, f"no {pattern} in {package}"
    try:
        out = subprocess.run(["ldd", files[0]], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"ldd failed: {err}"
    for line in out.splitlines():
        family = mpi_family(line.strip().split(" ", 1)[0])
        if family:
            return family, line.strip().split(" (")[0]
    return None, f"{os.path.basename(files[0])} links no MPI"


def foreign_h5py() -> Optional[str]:
    """Why the h5py on the path must not be imported here (it is linked to another MPI than
    mpi4py is), or ``None``."""
    mine, _ = linked_mpi("mpi4py", "MPI*.so")
    theirs, library = linked_mpi("h5py", "defs*.so")
    if mine is None or theirs is None or mine == theirs:
        return None
    return f"h5py is linked to {theirs} ({library}), but mpi4py runs {mine}"


def refuse_doctor(why: str) -> None:
    """``python -m mpistrat doctor`` with a foreign h5py: the ``libraries`` row, failed, as a
    table (or JSON with ``--json``) on the launcher's rank 0, then exit 1, before MPI starts
    and before anything loads h5py."""
    import json
    import sys
    rank = next((os.environ[n] for n in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
                 if os.environ.get(n, "").isdigit()), "0")
    if rank == "0":
        row = {"check": "libraries", "status": "fail", "found": f"{why}; not loaded",
               "fix": FIX}
        if "--json" in sys.argv:
            sys.stdout.write(json.dumps({"checks": [row]}, indent=1) + "\n")
        else:
            sys.stdout.write(f"libraries  FAIL  {row['found']}\n           fix: {FIX}\n\n"
                             f"1 check(s) failed (the others need h5py: fix this first)\n")
        sys.stdout.flush()
    sys.exit(1)

