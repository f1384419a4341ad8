"""Calibration: time each candidate all-reduce on this communicator, agree, keep the table.

``table_for(comm)`` is asked by ``backends/host.py`` the first time a buffer of 2 KiB or more
is all-reduced over ``comm`` with the automatic choice (collective then, like
``comm_topology``; cached on the communicator). What it does follows ``MPISTRAT_TUNING``
(rank 0's value, broadcast, so every rank takes the same branch):

* ``off``: no table: the static rules of ``algorithms.explain_algorithm``.
* ``auto`` (default): a table only when ``MPISTRAT_TUNING_FILE`` names a file: its table for
  this key when it holds a valid one (no calibration), else a calibration whose result rank 0
  writes there. Without a file nothing is measured (the test suite is not slowed).
* ``on``: as ``auto``, and without a file the calibration runs anyway (kept in memory).

``CommunicationOptions(algorithm=...)`` other than ``auto`` bypasses the table for its calls.
The calibration stops before a bucket that would not fit
in ``MPISTRAT_TUNING_BUDGET`` seconds (2); unmeasured buckets follow the static rules.
Each bucket is timed in both places (``tuning.PLACES``): into a buffer of its own, as a
tensor the caller keeps is reduced, and in place, as a fused bucket or a reproducible sum's
grid is: MPI's own in-place call is another program than its out-of-place one (at 2 ranks
here it beat our ring in place from 1 to 16 MiB, and lost to it out of place).
Every timing is all-reduced with MAX before ``tuning.pick`` sees it, so every rank holds the
same table::

    mpirun -n 4 python -m mpistrat tune --output tuning.json   # ahead of the job
    MPISTRAT_TUNING_FILE=tuning.json mpirun -n 4 python train.py
"""

import time
import warnings
from typing import Callable, Dict, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import tuning
from mpistrat.collectives.deadline import wait_all
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.topology import comm_topology
from mpistrat.runtime import settings

__all__ = ["table_for", "calibrate", "tune", "describe", "candidates_for", "install", "forget"]

_KEYVAL = MPI.Comm.Create_keyval()  # the table, or the text saying why there is none
_DTYPES = {4: np.float32, 8: np.float64}

# measure(comm, algorithm, size class, nbytes, in place) -> this rank's seconds for one call
Measure = Callable[[MPI.Comm, str, int, int, bool], float]


def candidates_for(topology) -> tuple:
    """The algorithms compared on ``topology``: hierarchical only across nodes of several
    ranks."""
    several = topology.num_nodes > 1 and max(topology.node_sizes) > 1
    return tuple(a for a in tuning.CANDIDATES if a != "hierarchical" or several)


def key_for(comm, topology) -> Dict:
    """The tuning key of ``comm``: host type, MPI library, ranks per node, nodes, size."""
    library = " ".join(MPI.Get_library_version().splitlines()[0].split()).rstrip(",")
    return tuning.table_key(library, max(topology.node_sizes), topology.num_nodes,
                            comm.Get_size())


def _reps(nbytes: int) -> int:
    """Timed calls per measurement (after one warm-up): more for small, cheap buffers."""
    return max(2, min(5, (4 << 20) // nbytes))


def _time_call(comm, algorithm: str, cls: int, nbytes: int, in_place: bool = False) -> float:
    """The least of a few timings of one all-reduce of ``nbytes`` (one warm-up call first),
    into a buffer of its own or in place (zeros then: repeated sums stay zero)."""
    from mpistrat.collectives import algorithms
    from mpistrat.collectives.backends import hierarchical
    send = np.zeros(nbytes // cls, _DTYPES[cls]) if in_place else \
        np.ones(nbytes // cls, _DTYPES[cls])
    recv = send if in_place else np.empty_like(send)
    reps = _reps(nbytes)

    def once():
        if algorithm == "hierarchical":
            hierarchical.host_allreduce(comm, send, recv, ReduceOp.SUM, None)
        else:
            algorithms.allreduce(comm, send, recv, ReduceOp.SUM, None, algorithm)

    comm.Barrier()
    once()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(comm, topology=None, budget: Optional[float] = None,
              measure: Optional[Measure] = None) -> tuning.TuningTable:
    """Measure every candidate per bucket, size class and place (collective); the agreed
    table.

    Each bucket's timings, and the time spent so far, are all-reduced with MAX: the choice
    and the decision to measure the next bucket are the same on every rank whatever each
    rank measured. ``measure`` replaces the timing (tests feed ranks different timings)."""
    topology = topology if topology is not None else comm_topology(comm)
    budget = settings.get("MPISTRAT_TUNING_BUDGET") if budget is None else budget
    measure = measure or _time_call
    names = candidates_for(topology)
    began = time.perf_counter()
    choices, times, spent = {}, {}, 0.0
    entries = [(cls, place) for place in tuning.PLACES for cls in tuning.SIZE_CLASSES]
    for bucket in tuning.BUCKETS:
        mine = [measure(comm, name, cls, bucket, place == "in")
                for cls, place in entries for name in names]
        mine.append(time.perf_counter() - began)
        agreed = np.empty(len(mine), np.float64)
        comm.Allreduce(np.array(mine, np.float64), agreed, MPI.MAX)
        for index, (cls, place) in enumerate(entries):
            row = dict(zip(names, agreed[index * len(names):(index + 1) * len(names)].tolist()))
            choices[(cls, bucket, place)] = tuning.pick(row)
            times[(cls, bucket, place)] = row
        cost, spent = float(agreed[-1]) - spent, float(agreed[-1])
        # the next bucket is 4x larger (fewer calls, though): stop if it would not fit
        following = 4 * bucket
        if spent + cost * 4 * (1 + _reps(following)) / (1 + _reps(bucket)) > budget:
            break
    return tuning.TuningTable(key_for(comm, topology), choices,
                              f"calibrated on this job ({spent:.2f} s)", times, spent)


def _decide(comm) -> Dict:
    """Rank 0's decision, broadcast: the mode, the file, and the table read from it."""
    decision = None
    if comm.Get_rank() == 0:
        mode = settings.get("MPISTRAT_TUNING")
        path = settings.get("MPISTRAT_TUNING_FILE")
        decision = {"mode": mode, "path": path, "table": None, "warning": None,
                    "why": None, "refine": settings.get("MPISTRAT_TUNING_REFINE")}
        if mode == "off":
            decision["why"] = "MPISTRAT_TUNING=off: the static rules"
        elif path is None and mode == "auto":
            decision["why"] = "MPISTRAT_TUNING_FILE unset: the static rules (docs/settings.md)"
        elif path is not None:
            key = key_for(comm, comm_topology(comm))
            try:
                decision["table"] = tuning.load_table(path, key)
            except FileNotFoundError:
                pass
            except Exception as err:  # noqa: BLE001 - a hostile file: rank 0 still broadcasts
                decision["warning"] = f"ignoring tuning file: {type(err).__name__}: {err}"
    return comm.bcast(decision, root=0)


def table_for(comm, deadline=None) -> Optional[tuning.TuningTable]:
    """The table ``comm``'s all-reduces follow, or ``None`` (the static rules); collective
    the first time for a communicator (then cached on it)."""
    if comm.Get_size() == 1:
        return None
    cached = comm.Get_attr(_KEYVAL)
    if cached is not None:
        return None if isinstance(cached, str) else cached
    table = _settle(comm, _decide_within(comm, deadline))
    comm.Set_attr(_KEYVAL, table)
    return None if isinstance(table, str) else table


def _decide_within(comm, deadline) -> Dict:
    # every rank learns the topology (collective) before rank 0 keys the file with it
    comm_topology(comm, deadline)
    if deadline is not None:  # the decision must not wait past the caller's deadline
        wait_all([comm.Ibarrier()], deadline, "tuning")
    return _decide(comm)


def _settle(comm, decision: Dict):
    """The table, or the text saying why there is none."""
    if decision["warning"]:
        warnings.warn(f"rank {comm.Get_rank()}: {decision['warning']}; measuring afresh",
                      stacklevel=3)
    if decision["why"]:
        return decision["why"]
    table = decision["table"]
    if table is None:
        table = calibrate(comm)
        if decision["path"] is not None:
            _write(comm, decision["path"], table)
    table.refine_calls = decision["refine"]  # rank 0's value: every rank refines alike
    return table


def _write(comm, path: str, table: tuning.TuningTable) -> Optional[str]:
    """Rank 0 writes ``table`` to ``path``; every rank returns the problem (a warning), or
    ``None`` when it was written."""
    problem = None
    if comm.Get_rank() == 0:
        try:
            tuning.save_table(path, table)
        except (OSError, tuning.TuningFileError) as err:
            problem = f"could not write the tuning file {path}: {err}"
    problem = comm.bcast(problem, root=0)
    if problem:
        warnings.warn(f"rank {comm.Get_rank()}: {problem}", stacklevel=4)
    else:
        table.source += f", written to {path}"
    return problem


def tune(comm, path: Optional[str], budget: Optional[float] = None) -> tuning.TuningTable:
    """Calibrate ``comm`` afresh (collective) and, with ``path``, write the table there
    (``python -m mpistrat tune``); the table is used by ``comm`` from now on."""
    table = calibrate(comm, budget=budget)
    problem = _write(comm, path, table) if path is not None else None
    comm.Set_attr(_KEYVAL, table)
    if problem:   # (on every rank: the command fails rather than exit 0 with no file)
        raise OSError(problem)
    return table


def install(comm, table: Optional[tuning.TuningTable]) -> None:
    """Make ``comm``'s all-reduces follow ``table`` (``None``: the static rules) from now on;
    every rank must install the same table (tests force algorithms through it), one table
    object per communicator (its refinement counts that communicator's calls)."""
    comm.Set_attr(_KEYVAL, table if table is not None else "installed: the static rules")


def forget(comm) -> None:
    """Drop ``comm``'s cached table: the next all-reduce decides again (tests)."""
    if comm.Get_attr(_KEYVAL) is not None:
        comm.Delete_attr(_KEYVAL)


def describe(comm) -> Dict:
    """The table in use on ``comm`` and where it came from (collective: may calibrate)."""
    table = table_for(comm)
    if table is None:
        why = "one rank: nothing to tune" if comm.Get_size() == 1 else comm.Get_attr(_KEYVAL)
        return {"source": why, "entries": []}
    return {"source": table.source, "key": table.key, "entries": table.rows()}
