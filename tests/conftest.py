"""Shared test set-up: the MPI header line and helpers for launcher tests."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = ROOT / "scripts" / "mpirun"


def pytest_report_header(config):
    from mpi4py import MPI
    import h5py
    import mpi4py
    comm = MPI.COMM_WORLD
    vendor = MPI.Get_library_version().splitlines()[0].strip().rstrip(",")
    return [f"MPI: {vendor}; rank {comm.Get_rank()} of {comm.Get_size()}; mpi4py "
            f"{mpi4py.__version__}; h5py {h5py.__version__} (parallel={h5py.get_config().mpi})"]


# Defines say(): one write per line, so lines of different ranks do not interleave.
PRELUDE = (
    "import sys as _sys\n"
    "def say(*parts):\n"
    "    _sys.stdout.write(' '.join(str(p) for p in parts) + '\\n')\n"
    "    _sys.stdout.flush()\n"
)


def descendants(pid: int) -> list:
    """Every process below ``pid`` (its children, theirs, ...) as ``(parent, child)`` pairs,
    each parent before its children, from one reading of ``/proc/*/stat`` (the field after
    the command name's closing parenthesis and the state is the parent's pid). A process
    that ends meanwhile is left out."""
    children: dict = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = children.get(parent, [])
        found += [(parent, kid) for kid in kids]
        todo += kids
    return found


class Launched:
    """The outcome of a launched MPI job."""

    def __init__(self, returncode: int, output: str, seconds: float):
        self.returncode, self.output, self.seconds = returncode, output, seconds

    def __repr__(self):
        return f"<exit {self.returncode} after {self.seconds:.1f}s>\n{self.output[-4000:]}"


@pytest.fixture
def launch(tmp_path):
    """Run ``scripts/mpirun -n N python SCRIPT`` and return a ``Launched``."""

    def run(nprocs: int, script: str, *args: str, limit: int = 120, env=None,
            mpirun_args=()) -> Launched:
        path = tmp_path / "job.py"
        path.write_text(PRELUDE + script)
        # Drop the variables of this process's own (singleton) MPI run, so the
        # launched mpirun starts a fresh job instead of joining this one.
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
        full_env.update(env or {})
        start = time.monotonic()
        done = subprocess.run([str(MPIRUN), "--limit", str(limit), *mpirun_args, "-n", str(nprocs),
                               sys.executable, str(path), *args], cwd=tmp_path, env=full_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return Launched(done.returncode, done.stdout, time.monotonic() - start)

    return run
