"""Fault injection for tests: kill this rank at a named point, never by accident.

Only when the environment held ``MPISTRAT_TEST_FAULT=POINT:RANK:N[:KILL|STOP]``
at import does ``fault_point(POINT)`` do anything: the N-th time rank RANK of the
world passes POINT, it kills itself with SIGKILL (a real crash, for tests of torn
saves) or, with ``STOP``, stops itself with SIGSTOP (a rank that stopped
answering, for tests of timeouts). Otherwise ``fault_point`` is a function that returns at once.

    >>> from mpistrat.runtime.faults import fault_point
    >>> fault_point("checkpoint-partition-written")   # no fault armed: nothing happens
"""

import os
import signal

from mpistrat.runtime import settings

__all__ = ["fault_point"]

_SPEC = settings.get("MPISTRAT_TEST_FAULT", at_import=True)  # (point, rank, count) or None
_HITS: dict = {}


def _armed(name: str) -> None:
    point, rank, count, how = _SPEC
    if name != point:
        return
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != rank:
        return
    _HITS[name] = _HITS.get(name, 0) + 1
    if _HITS[name] == count:
        os.kill(os.getpid(), signal.SIGSTOP if how == "STOP" else signal.SIGKILL)


def _disarmed(name: str) -> None:
    return None


fault_point = _armed if _SPEC else _disarmed
