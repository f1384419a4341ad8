"""``MPISTRAT_TRACE=1``: one line per collective and one per way it ran, on stderr, tagged
with the rank (the ``mpistrat.collectives`` logger; a handler set up here at import)::

    [mpistrat rank 0] #1 all_reduce SUM: 1 tensors, 3 elements, timeout=None
    [mpistrat rank 0] #1 all_reduce SUM: 1 numpy tensors via validation-probe
"""

import logging
import sys

import numpy as np
from mpi4py import MPI

from mpistrat.runtime import settings

__all__ = ["log", "on", "call", "route"]

log = logging.getLogger("mpistrat.collectives")


def _configure() -> None:
    if not settings.get("MPISTRAT_TRACE", at_import=True) or log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    rank = MPI.COMM_WORLD.Get_rank()
    handler.setFormatter(logging.Formatter(f"[mpistrat rank {rank}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


_configure()


def on() -> bool:
    """Whether collectives are traced (read once by each engine)."""
    return log.isEnabledFor(logging.DEBUG)


def call(number: int, what: str, signature: tuple, timeout) -> None:
    """The line of call ``number``: its tensors, elements and timeout."""
    total = sum(int(np.prod(shape, dtype=np.int64)) for _, shape in signature)
    log.debug("#%d %s: %d tensors, %d elements, timeout=%s", number, what, len(signature),
              total, timeout)


def route(number: int, what: str, count: int, kinds: str, way: str) -> None:
    """The line saying how ``count`` tensors of call ``number`` ran (the op or backend)."""
    log.debug("#%d %s: %d %s tensors via %s", number, what, count, kinds, way)
