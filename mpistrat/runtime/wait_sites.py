"""Where a thread of this rank waits for its peers, read from its Python stack.

The health check (``health.py``) asks this module, without any cost on the
collectives themselves: a thread *waits for peers* when its innermost Python
frame belongs to a module of mpistrat that communicates (the collectives,
checkpoints, distributed datasets, strategies, the preemption boundary, the
world and the timeline) and is not one of the known idle loops. A blocking MPI
call adds no Python frame, so the frame that made it is the innermost one::

    >>> import sys
    >>> from mpistrat.runtime.wait_sites import waiting_frame, describe
    >>> waiting_frame(sys._getframe()) is None      # this doctest is not inside mpistrat
    True
"""

import os
import sys
import types
from typing import Optional, Tuple

__all__ = ["waiting_frame", "describe", "comm_of", "COMMUNICATING"]

# Modules whose innermost frame means "inside a collective" (prefixes, by module name).
COMMUNICATING = ("mpistrat.collectives", "mpistrat.checkpoint", "mpistrat.distribute.input_lib",
                 "mpistrat.distribute", "mpistrat.preemption", "mpistrat.runtime.world",
                 "mpistrat.runtime.timeline", "mpistrat.runtime.jax_bridge",
                 "mpistrat.runtime.gpus", "mpistrat.tpu")
# Functions of those modules that idle on their own (a watcher's sleep), never waits.
IDLE = {("mpistrat.preemption", "_watch")}


def _module(frame: types.FrameType) -> str:
    return frame.f_globals.get("__name__", "") or ""


def waiting_frame(frame: Optional[types.FrameType]) -> Optional[types.FrameType]:
    """``frame`` when it (a thread's innermost frame) is a wait for peers, else ``None``."""
    if frame is None:
        return None
    module = _module(frame)
    if not module.startswith(COMMUNICATING) or (module, frame.f_code.co_name) in IDLE:
        return None
    return frame


def _inside_package(frame: types.FrameType) -> bool:
    module = _module(frame)
    return module == "mpistrat" or module.startswith("mpistrat.")


def _where(frame: types.FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def describe(frame: Optional[types.FrameType]) -> str:
    """What a thread does, in words: the operation (the ``what`` text of the collective, when
    one is in scope), the public mpistrat call and its caller's file:line; or, outside
    mpistrat, where the program runs.

    Reads the frames' locals: call it only when reporting (once), never to poll.
    """
    if frame is None:
        return "has no Python frame"
    if not _inside_package(frame):
        return f"runs {_where(frame)} ({frame.f_code.co_name})"
    what, entry = None, frame
    while frame is not None and _inside_package(frame):
        if what is None:
            value = frame.f_locals.get("what")
            what = value if isinstance(value, str) else None
        entry, frame = frame, frame.f_back
    name = getattr(entry.f_code, "co_qualname", entry.f_code.co_name)
    called = f"called at {_where(frame)}" if frame is not None else ""
    if what:
        return f"waits in {what} ({name}{', ' + called if called else ''})"
    return f"waits in {name}" + (f" ({called})" if called else "")


def comm_of(frame: Optional[types.FrameType]):
    """The first MPI communicator in scope along the stack (a ``comm`` local or
    ``self.comm``), or ``None``; read only when reporting, as ``describe``."""
    MPI = sys.modules.get("mpi4py.MPI")
    while MPI is not None and frame is not None and _inside_package(frame):
        local = frame.f_locals
        for candidate in (local.get("comm"), getattr(local.get("self"), "comm", None)):
            if isinstance(candidate, MPI.Comm):
                return candidate
        frame = frame.f_back
    return None


def members(comm, world_ranks) -> Tuple[int, ...]:
    """Which of ``world_ranks`` belong to ``comm`` (a local MPI operation)."""
    from mpi4py import MPI
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        inside = MPI.Group.Translate_ranks(world, list(world_ranks), group)
    finally:
        group.Free()
        world.Free()
    return tuple(r for r, t in zip(world_ranks, inside) if t != MPI.UNDEFINED)
