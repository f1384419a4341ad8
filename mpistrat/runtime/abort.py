"""End the whole job when one rank raises an uncaught exception.

With plain mpi4py, a rank that dies leaves the others waiting in their next
collective until the scheduler kills the job. mpistrat installs hooks (on
import, unless ``MPISTRAT_ABORT_ON_ERROR=0``) that print the traceback tagged
with the rank, then call ``MPI_Abort`` so that ``mpirun`` ends every rank::

    >>> from mpistrat.runtime import install_abort_hook
    >>> hooked = install_abort_hook()   # idempotent; mpistrat calls it on import
"""

import sys
import threading
import time
import traceback

from mpi4py import MPI

from mpistrat.runtime import health, settings

__all__ = ["install_abort_hook", "abort_job", "tag_lines"]

ABORT_ENV = "MPISTRAT_ABORT_ON_ERROR"
_installed = False


def tag_lines(text: str, tag: str) -> str:
    """Prefix every line of ``text`` with ``tag`` (pure helper).

    >>> tag_lines("a\\nb\\n", "[rank 1]")
    '[rank 1] a\\n[rank 1] b\\n'
    """
    return "".join(f"{tag} {line}" for line in text.splitlines(keepends=True))


_FORWARD_SECONDS = 0.25


def abort_job(exc_type, exc, tb, where: str = "") -> None:
    """Print the traceback tagged with this rank, then abort every rank."""
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    tag = f"[mpistrat rank {rank}/{size}]"
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    header = f"uncaught {exc_type.__name__}{where}; aborting all {size} ranks\n"
    try:
        health.announce_abort(f"uncaught {exc_type.__name__}{where}: {exc}")
        sys.stderr.write(tag_lines(header + text, tag))
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(_FORWARD_SECONDS)   # the launcher forwards what was written before the
    finally:                           # abort ends its readers (MPICH's Hydra dropped it)
        MPI.COMM_WORLD.Abort(1)


def _excepthook(exc_type, exc, tb):
    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        sys.__excepthook__(exc_type, exc, tb)
        return
    abort_job(exc_type, exc, tb)


def _thread_excepthook(args):
    if args.exc_type is SystemExit or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        threading.__excepthook__(args)
        return
    name = getattr(args.thread, "name", "?")
    abort_job(args.exc_type, args.exc_value, args.exc_traceback, f" in thread {name!r}")


def install_abort_hook() -> bool:
    """Install the hooks unless ``MPISTRAT_ABORT_ON_ERROR=0``; return whether they are on."""
    global _installed
    if not settings.get(ABORT_ENV, at_import=True):
        return False
    if not _installed:
        sys.excepthook = _excepthook
        threading.excepthook = _thread_excepthook
        _installed = True
    return True
