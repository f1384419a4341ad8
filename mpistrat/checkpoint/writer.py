"""One checkpoint writer per process: async saves in flight one at a time.

Every checkpoint operation of every ``Checkpoint`` object uses the same
checkpoint communicator, so they are serialised here: a save, a restore or a
``latest_checkpoint`` first waits for the save in flight (whichever object
started it). A save still in flight when the interpreter exits is completed
before MPI is finalised (as TensorFlow's async checkpoints are); if it fails
then, the error is printed and the process exits with status 1.

    >>> from mpistrat.checkpoint.writer import start, wait_idle
    >>> job = start(lambda: None, name="noop")
    >>> wait_idle(); job.error is None
    True
"""

import atexit
import os
import sys
import threading
from typing import Callable, Optional

import h5py  # noqa: F401 - imported first so that its exit handler runs after ours
from mpi4py import MPI  # noqa: F401 - likewise MPI's finalisation

__all__ = ["Job", "start", "wait_idle", "in_flight"]


class Job:
    """A save running in the writer thread; ``error`` is set if it failed."""

    def __init__(self, fn: Callable[[], None], name: str):
        self.name = name
        self.error: Optional[BaseException] = None
        self.reported = False
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=f"mpistrat-save {name}",
                                        daemon=True)

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as err:  # noqa: BLE001 - surfaced by sync() or at exit
            self.error = err

    def join(self) -> None:
        self._thread.join()

    def take_error(self) -> Optional[BaseException]:
        """The error, once: later calls (and the exit check) see it as reported."""
        self.join()
        self.reported = True
        return self.error


_LOCK = threading.Lock()
_CURRENT: list = []  # the job in flight (or the last one), at most one


def in_flight() -> Optional[Job]:
    """The last job started, finished or not."""
    return _CURRENT[0] if _CURRENT else None


def wait_idle() -> None:
    """Wait for the save in flight, if any (its error stays with its job)."""
    job = in_flight()
    if job is not None:
        job.join()


def start(fn: Callable[[], None], name: str) -> Job:
    """Run ``fn`` in the writer thread once the previous save has finished."""
    with _LOCK:
        wait_idle()
        job = Job(fn, name)
        _CURRENT[:] = [job]
        job._thread.start()
        return job


def _finish_at_exit() -> None:
    job = in_flight()
    if job is None:
        return
    job.join()
    if job.error is not None and not job.reported:
        sys.stderr.write(f"mpistrat: the asynchronous checkpoint save {job.name} failed and "
                         f"was never synced: {type(job.error).__name__}: {job.error}\n")
        sys.stderr.flush()
        os._exit(1)


# atexit runs handlers last-registered first: registered after h5py's and mpi4py's own
# clean-up (both imported above), so a save in flight finishes before they run.
atexit.register(_finish_at_exit)
