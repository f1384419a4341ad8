"""Online refinement: the tuning table corrected by the timings of the job's real all-reduces.

Calibration (``calibration.py``) times each algorithm on warm buffers of its own before the
job's first large all-reduce; the job's calls run on its own memory, often cold, between its
computations. Where a table is in use and ``MPISTRAT_TUNING_REFINE`` is above 0 (rank 0's
value, agreed with the table), each bucket's choice is put to the test in real calls: the
chosen algorithm runs ``calls`` real all-reduces, then each algorithm calibrated within
``TRY_WITHIN`` of it runs as many, and the bucket keeps the fastest of those real means
(``tuning.pick``: MPI's own unless beaten by 5%). A bucket settles after one round; the table
then shows the real means (``info``).

No rank chooses differently: ranks make the same all-reduces of the same sizes (their
signatures are agreed), so their per-bucket call counts meet at the same call; there each
mean is all-reduced with MAX and every decision below is a pure function of agreed means::

    >>> trial = BucketTrial("ring", {"mpi": 1.0, "ring": 0.9, "rabenseifner": 2.0}, calls=2)
    >>> trial.queue
    ['mpi']
    >>> trial.record(1.2), trial.record(1.2)        # the ring's real calls: 1.2 each
    (False, True)
    >>> trial.decide(1.2)                           # agreed mean 1.2: MPI's own is next
    'mpi'
    >>> trial.record(1.0), trial.record(1.0)
    (False, True)
    >>> trial.decide(1.0), trial.settled            # MPI's own ran faster in the job
    ('mpi', True)
"""

import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives import tuning
from mpistrat.collectives.deadline import wait_all

__all__ = ["BucketTrial", "TRY_WITHIN", "run_refined"]

# alternatives whose calibrated time is within this factor of the choice are tried for real
TRY_WITHIN = 1.5


class BucketTrial:
    """The refinement of one ``(size class, bucket, place)``: the algorithm running now
    (``current``), those still to try (``queue``, fastest calibrated first), the agreed real
    mean of each one tried (``measured``, seconds per bucket-sized call)."""

    def __init__(self, choice: str, calibrated: Dict[str, float], calls: int):
        self.current = choice
        base = calibrated.get(choice)
        self.queue: List[str] = [] if base is None else [
            name for name in sorted(calibrated, key=lambda n: (calibrated[n], n))
            if name != choice and calibrated[name] <= base * TRY_WITHIN]
        self.measured: Dict[str, float] = {}
        self.calls = max(1, int(calls))
        self.settled = not self.queue
        self._count, self._total = 0, 0.0

    def record(self, seconds: float) -> bool:
        """Count one real call of ``current``; ``True`` when its ``calls`` are done (the
        caller agrees the ``mean`` with the other ranks, then calls ``decide``)."""
        self._count += 1
        self._total += seconds
        return self._count >= self.calls

    def mean(self) -> float:
        return self._total / max(self._count, 1)

    def decide(self, agreed_mean: float) -> str:
        """Keep ``current``'s agreed mean; the algorithm that runs next: the next one to try,
        else (settled) the fastest measured."""
        self.measured[self.current] = float(agreed_mean)
        self._count, self._total = 0, 0.0
        if self.queue:
            self.current = self.queue.pop(0)
        else:
            self.current = tuning.pick(self.measured)
            self.settled = True
        return self.current


def _agreed_max(comm, value: float, deadline) -> float:
    mine, agreed = np.array([value]), np.empty(1)
    if deadline is None:
        comm.Allreduce(mine, agreed, MPI.MAX)
    else:
        wait_all([comm.Iallreduce(mine, agreed, MPI.MAX)], deadline, "tuning (refinement)")
    return float(agreed[0])


def run_refined(comm, table: "tuning.TuningTable", nbytes: int, itemsize: int, deadline,
                run: Callable[[str], None], in_place: bool = False) -> Optional[str]:
    """Run one all-reduce of ``nbytes`` (``in_place`` or not) with the table's choice for
    its entry, refining it (see the module docstring); the algorithm that ran, or ``None``
    when the table has no choice there (the caller's static rules apply)."""
    key: Optional[Tuple[int, int, str]] = tuning.key_of(nbytes, itemsize, in_place)
    if key is None:
        return None
    bucket = key[1]
    choice = table.choices.get(key)
    if choice is None:
        return None
    if table.refine_calls <= 0:
        run(choice)
        return choice
    trial = table.trials.get(key)
    if trial is None:
        trial = table.trials[key] = BucketTrial(choice, table.times.get(key, {}),
                                                table.refine_calls)
    algorithm = trial.current
    if trial.settled:
        run(algorithm)
        return algorithm
    start = time.perf_counter()
    run(algorithm)
    if trial.record((time.perf_counter() - start) * bucket / nbytes):
        trial.decide(_agreed_max(comm, trial.mean(), deadline))
        if trial.settled:
            table.choices[key] = trial.current
            table.online[key] = dict(trial.measured)
    return algorithm
