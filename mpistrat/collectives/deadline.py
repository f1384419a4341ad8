"""Waiting on MPI requests with an optional deadline.

    >>> from mpi4py import MPI
    >>> from mpistrat.collectives.deadline import Deadline, wait_all
    >>> request = MPI.COMM_SELF.Ibarrier()
    >>> wait_all([request], Deadline.after(5.0), "barrier")
"""

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from mpi4py import MPI

from mpistrat.errors import DeadlineExceededError

__all__ = ["Deadline", "wait_all"]


@dataclass(frozen=True)
class Deadline:
    """A point in ``time.monotonic()`` time, with the timeout it came from."""

    at: float
    seconds: float

    @classmethod
    def after(cls, seconds: Optional[float]) -> Optional["Deadline"]:
        """A deadline ``seconds`` from now, or ``None`` for no limit."""
        if seconds is None:
            return None
        return cls(time.monotonic() + seconds, seconds)

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def wait_all(requests: Sequence[MPI.Request], deadline: Optional[Deadline], what: str) -> None:
    """Complete ``requests``; past ``deadline``, raise ``DeadlineExceededError``.

    The error carries the unfinished requests as ``pending_requests``.

    Polls with a short back-off (10 µs growing to 1 ms), so a fast collective
    pays little while a stalled one is noticed within a millisecond.
    """
    if deadline is None:
        MPI.Request.Waitall(list(requests))
        return
    requests = list(requests)
    pause = 1e-5
    while not MPI.Request.Testall(requests):
        if deadline.expired():
            error = DeadlineExceededError(
                f"{what} did not complete within timeout_seconds={deadline.seconds:g} on rank "
                f"{MPI.COMM_WORLD.Get_rank()}: another rank did not join it (still computing, "
                f"hung or dead); the communicator is now unusable, restart the job")
            error.pending_requests = requests  # still active: complete or cancel them
            raise error
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
