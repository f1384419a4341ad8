"""A timeline of collectives (and of any other step), as one Chrome trace for Perfetto.

Set ``MPISTRAT_TIMELINE=/path/trace.json`` and every rank records each
collective: when it started and ended, the bytes, the backend, the algorithm
of each bucket, and (filled in when the ranks' records are merged) how long
this rank waited for the slowest one. At exit, or at an explicit
``flush()`` (collective), rank 0 merges every rank's events into one trace-event
JSON file that https://ui.perfetto.dev or ``chrome://tracing`` opens: one
process per rank, one row per thread.

``MPISTRAT_TIMELINE`` is a per-rank setting; at exit the rule is:

* **every rank sets it** (as the ranks told each other when the library's
  world was made, ``settings.agree``; or a job of one process): the merge
  above, a collective every rank joins, into rank 0's path;
* **some ranks only** (``mpirun -n 1 env MPISTRAT_TIMELINE=t.json python job.py
  : -n 1 python job.py``), or no world was ever made in a job of several
  ranks: each rank that sets it writes its own ``PATH.rank<r>.json`` (its
  events only, process ``rank r``) with **no collective**, and the ranks
  that do not set it write nothing. (A collective at exit that only some
  ranks join would never end: the health check would end the job, exit 1.)

Other layers add their own spans; off, each costs one attribute test::

    >>> from mpistrat.runtime import timeline
    >>> with timeline.span("write model/dense/kernel", "checkpoint", nbytes=4096):
    ...     pass
    >>> with timeline.recording() as events:     # tests: record into a list
    ...     with timeline.span("read batch 3", "dataset", nbytes=64):
    ...         pass
    >>> [(e.name, e.category, e.nbytes) for e in events]
    [('read batch 3', 'dataset', 64)]

Clocks are aligned at the merge (a barrier, then every rank reads its clock);
``wait_us`` of a collective is the latest start among the ranks minus this
rank's start: the time it spent waiting for the slowest rank to arrive.
"""

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

from mpi4py import MPI

from mpistrat.runtime import settings
from mpistrat.safe_files import replace_atomically

__all__ = ["Event", "ON", "PATH_ENV", "span", "record", "begin", "wait_ready", "end",
           "note_algorithm",
           "recording", "flush", "chrome_trace", "enable", "disable", "now"]

PATH_ENV = "MPISTRAT_TIMELINE"
now = time.perf_counter


class Event(NamedTuple):
    """One recorded span: times in ``time.perf_counter`` seconds of its rank."""

    name: str
    category: str
    start: float
    end: float
    nbytes: int
    thread: int
    args: Optional[Dict[str, Any]]


#: True while events are recorded: the one test callers make on their hot path.
ON = False
_events: List[Event] = []
_path: Optional[str] = None
_algorithms: List[str] = []   # algorithms used by the collective now open (main thread)
_lock = threading.Lock()


def enable(path: Optional[str]) -> None:
    """Start recording; ``flush`` (and the exit hook) write to ``path`` when given."""
    global ON, _path
    _path = path
    ON = True


def disable() -> None:
    """Stop recording (events recorded so far are kept until the next ``flush``)."""
    global ON
    ON = False


def record(name: str, category: str, start: float, end: float, nbytes: int = 0,
           args: Optional[Dict[str, Any]] = None) -> None:
    """Add one finished span (times from ``now()``)."""
    if ON:
        _events.append(Event(name, category, start, end, int(nbytes), threading.get_ident(),
                             args))


class _Span:
    __slots__ = ("name", "category", "nbytes", "args", "start")

    def __init__(self, name, category, nbytes, args):
        self.name, self.category, self.nbytes, self.args = name, category, nbytes, args

    def __enter__(self):
        self.start = now()
        return self

    def __exit__(self, *exc):
        record(self.name, self.category, self.start, now(), self.nbytes, self.args or None)
        return False


_NULL = contextlib.nullcontext()


def span(name: str, category: str, nbytes: int = 0, **args):
    """A context manager that records a span around its body (a shared no-op when off).

    ``nbytes`` may be updated inside: ``with span(...) as s: s.nbytes = n``.
    """
    if not ON:
        return _NULL
    return _Span(name, category, nbytes, args)


def begin(value: Any = None) -> float:
    """Start a collective: clears the algorithm notes; returns the start time.

    ``value``: the collective's input. JAX computes asynchronously, so its
    arrays may still be in flight; they are waited for first
    (``block_until_ready``), and that wait is recorded as its own slice
    (``"wait for JAX arrays"``, category ``compute``) before the collective's,
    so the collective is not charged with the computation that made them.
    """
    _algorithms.clear()
    if value is not None:
        wait_ready(value)
    return now()


def _jax_leaves(value: Any) -> List[Any]:
    """The concrete JAX arrays in a nest (never imports JAX: it is there if they are)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return []
    return [leaf for leaf in jax.tree_util.tree_leaves(value)
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)]


def wait_ready(value: Any) -> None:
    """Wait for the JAX arrays in ``value``; record the wait as a ``compute`` slice."""
    leaves = _jax_leaves(value)
    if not leaves:
        return
    start = now()
    sys.modules["jax"].block_until_ready(leaves)
    record("wait for JAX arrays", "compute", start, now(),
           sum(int(getattr(a, "nbytes", 0)) for a in leaves), {"arrays": len(leaves)})


def note_algorithm(name: str, nbytes: int, start: float) -> None:
    """Called by a collective algorithm for each bucket it ran (a child span)."""
    _algorithms.append(name)
    record(name, "bucket", start, now(), nbytes)


def end(name: str, start: float, nbytes: int, args: Dict[str, Any]) -> None:
    """Finish a collective begun with ``begin``; the bucket algorithms join its args."""
    if _algorithms:
        args["algorithm"] = ",".join(sorted(set(_algorithms)))
    record(name, "collective", start, now(), nbytes, args)


@contextlib.contextmanager
def recording() -> Iterator[List[Event]]:
    """Record into a fresh list for the duration (tests, ad-hoc measurements)."""
    global ON, _events
    saved = ON, _events
    _events = []
    ON = True
    try:
        yield _events
    finally:
        ON, _events = saved


# -- merging ------------------------------------------------------------------
def chrome_trace(per_rank: List[List[Event]], offsets: List[float],
                 ranks: Optional[List[int]] = None) -> Dict[str, Any]:
    """Chrome trace-event JSON of every rank's events (a pure function).

    ``offsets[r]``: rank r's clock minus rank 0's. Collectives recorded with
    the same ``(engine, seq)`` on several ranks get ``wait_us``. ``ranks``: the
    rank of each list of events (its process in the trace; default 0, 1, ...).
    """
    aligned = [[(e, e.start - offsets[r], e.end - offsets[r]) for e in events]
               for r, events in enumerate(per_rank)]
    starts = [s for events in aligned for _, s, _ in events]
    origin = min(starts) if starts else 0.0
    latest: Dict[tuple, float] = {}
    for events in aligned:
        for e, s, _ in events:
            if e.category == "collective" and e.args and "seq" in e.args:
                key = (e.args.get("engine"), e.args["seq"])
                latest[key] = max(latest.get(key, s), s)
    trace: List[Dict[str, Any]] = []
    for index, events in enumerate(aligned):
        rank = index if ranks is None else ranks[index]
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                      "args": {"name": f"rank {rank}"}})
        threads: Dict[int, int] = {}
        for e, s, t in events:
            tid = threads.setdefault(e.thread, len(threads))
            args = dict(e.args or {})
            args["bytes"] = e.nbytes
            if e.category == "collective" and "seq" in args:
                args["wait_us"] = round((latest[(args.get("engine"), args["seq"])] - s) * 1e6, 3)
            trace.append({"name": e.name, "cat": e.category, "ph": "X", "pid": rank, "tid": tid,
                          "ts": round((s - origin) * 1e6, 3),
                          "dur": round(max(t - s, 0.0) * 1e6, 3), "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"producer": "mpistrat", "ranks": len(per_rank)}}


def _wait(request, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)
    return True


def flush(path: Optional[str] = None, comm: Optional[MPI.Comm] = None,
          timeout: float = 60.0) -> Optional[str]:
    """Merge every rank's events into ``path`` (default: ``MPISTRAT_TIMELINE``) on rank 0.

    Collective over ``comm`` (default: the library's private communicator, or
    ``COMM_WORLD`` if no strategy was ever made): call it on every rank. Returns
    the path written on rank 0 (``None`` elsewhere). If some rank does not arrive
    within ``timeout`` seconds, each rank writes its own ``path.rank<r>.json``
    instead. (The exit hook calls it only when every rank set ``MPISTRAT_TIMELINE``;
    see the module's docstring.)
    """
    path = path or _path
    if path is None:
        raise ValueError(f"timeline.flush: no path given and {PATH_ENV} is not set")
    if comm is None:
        from mpistrat.runtime import world as _world  # made by the first strategy, if any
        comm = _world._WORLD.comm if _world._WORLD is not None else MPI.COMM_WORLD
    rank = comm.Get_rank()
    with _lock:
        mine = list(_events)
    arrived = _wait(comm.Ibarrier(), timeout)
    if not arrived:  # some rank is gone: keep what this one has
        _write_own(path, rank, mine)
        return None
    clock = now()
    everyone = comm.gather((clock, mine), root=0)
    if rank != 0:
        return None
    base = everyone[0][0]
    _write(path, chrome_trace([ev for _, ev in everyone], [c - base for c, _ in everyone]))
    return path


def _write_own(path: str, rank: int, events: Optional[List[Event]] = None) -> str:
    """Write this rank's events alone to ``path.rank<r>.json`` (no communication)."""
    if events is None:
        with _lock:
            events = list(_events)
    own = f"{path}.rank{rank}.json"
    _write(own, chrome_trace([events], [0.0], ranks=[rank]))
    return own


def _exit_scope():
    """``(comm, rank, merge)`` for the exit hook, with no communication: ``merge`` when every
    rank of the library's world set MPISTRAT_TIMELINE (they told each other when the world
    was made) or the job is one process; else this rank writes its own trace."""
    from mpistrat.runtime import world as _world  # made by the first strategy, if any
    world = _world._WORLD
    if world is not None:
        asked = getattr(world, "set_by", {}).get(PATH_ENV, ())
        return world.comm, world.rank, len(asked) == world.size
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size() == 1


def _write(path: str, trace: Dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    text = json.dumps(trace).encode()
    replace_atomically(path, lambda handle: handle.write(text))  # O_EXCL|O_NOFOLLOW, random


def _flush_at_exit() -> None:
    if _path and not MPI.Is_finalized():
        try:
            comm, rank, merge = _exit_scope()
            if merge:    # every rank runs this hook: the collective merge
                flush(_path, comm=comm, timeout=30.0)
            else:        # some ranks only: never a collective the others would not join
                _write_own(_path, rank)
        except Exception as err:  # never turn a clean exit into a crash
            print(f"[mpistrat] timeline: could not write {_path}: {err}")


if settings.get(PATH_ENV, at_import=True):
    enable(settings.get(PATH_ENV, at_import=True))
    atexit.register(_flush_at_exit)
