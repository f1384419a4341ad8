"""Preemption-safe training: save at one agreed step when Slurm says time is up, then exit.

``ms.distribute.experimental.PreemptionCheckpointHandler`` and ``TerminationConfig``, as in
TensorFlow. The handler restores the latest checkpoint when it is made (its run count
included), watches for SIGTERM and SIGUSR1 (Slurm's preemption / time-limit signal and the
warning of ``#SBATCH --signal=B:USR1@120``), and when any rank receives one, every rank saves
a checkpoint at the same step boundary and exits with ``PREEMPTED_EXIT_CODE`` (75, EX_TEMPFAIL),
which the Slurm templates turn into ``scontrol requeue``::

    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        w = ms.Variable(np.zeros(4), aggregation=ms.VariableAggregation.MEAN)
    manager = ms.CheckpointManager(ms.Checkpoint(w=w), "/scratch/run", max_to_keep=2)
    handler = ms.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, manager)               # restores the latest checkpoint
    while handler.total_run_calls < 1000:                 # continues where it stopped
        handler.run(strategy.run, step, args=(batch(handler.total_run_calls),))

How the ranks agree (no barrier per step): at every step boundary (each ``run`` or
``save_checkpoint_if_preempted``), a rank waits for the 16-byte ``Iallreduce`` it posted at
the previous boundary, which every rank posted too and which has long completed behind the
step's own collectives, then posts a new one with its own flag. A signal that arrives during step k
is posted at boundary k+1 and seen by every rank at boundary k+2, the same boundary on all
ranks, where they save and exit. The exchange runs on a private communicator, so it never
meets the training collectives.
"""

import atexit
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint import Checkpoint, CheckpointManager
from mpistrat.distribute import experimental as _experimental
from mpistrat.runtime import get_world

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig", "PREEMPTED_EXIT_CODE",
           "WATCHED_SIGNALS"]

PREEMPTED_EXIT_CODE = 75   # EX_TEMPFAIL: "try again"; slurm/*.sbatch requeue the job on it
WATCHED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TerminationConfig:
    """How a preemption is noticed and what happens after the checkpoint.

    ``termination_watcher_fn``: a function polled about once a second in a thread; returning
    True counts as a preemption signal (for platforms that announce preemption otherwise).
    ``exit_fn``: called on every rank after the save (default: ``sys.exit(75)``).
    ``grace_period``: seconds between the signal and the hard kill; a save that ends later
    is reported as too late. ``save_fn``: called instead of the default save (collective).

    >>> import mpistrat as ms
    >>> ms.distribute.experimental.TerminationConfig(grace_period=120).grace_period
    120
    """

    def __init__(self, termination_watcher_fn: Optional[Callable[[], bool]] = None,
                 exit_fn: Optional[Callable[[], Any]] = None,
                 grace_period: Optional[float] = None,
                 save_fn: Optional[Callable[[], Any]] = None):
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


class _RunCounter:
    """The handler's run count, saved in the checkpoint as ``preemption/total_run_calls``."""

    def __init__(self):
        self.value = 0

    def _serialize_to_tensors(self):
        return {"total_run_calls": np.array(self.value, dtype=np.int64)}

    def _restore_from_tensors(self, tensors):
        self.value = int(tensors["total_run_calls"])


class PreemptionCheckpointHandler:
    """Save a checkpoint on every rank at one agreed step when any rank is told to stop.

    Collective to create: every rank makes one, in the same order as other collectives.
    ``checkpoint_or_checkpoint_manager``: an ``ms.CheckpointManager`` (its directory is used),
    or an ``ms.Checkpoint`` with ``checkpoint_dir`` (a manager keeping one checkpoint is
    made there). The run count is attached to the checkpoint as ``preemption`` and the
    latest checkpoint is restored at once, so ``total_run_calls`` continues where it stopped.
    ``cluster_resolver`` is accepted for TensorFlow compatibility (the MPI job is the cluster).
    ``restored_from`` (an extension) is the checkpoint restored on construction, or ``None``.
    """

    def __init__(self, cluster_resolver=None, checkpoint_or_checkpoint_manager=None,
                 checkpoint_dir: Optional[str] = None,
                 termination_config: Optional[TerminationConfig] = None):
        target = checkpoint_or_checkpoint_manager
        if isinstance(target, CheckpointManager):
            self._manager = target
        elif isinstance(target, Checkpoint):
            if checkpoint_dir is None:
                raise ValueError("PreemptionCheckpointHandler got an ms.Checkpoint without "
                                 "checkpoint_dir: pass the directory to save in, or a "
                                 "CheckpointManager")
            self._manager = CheckpointManager(target, checkpoint_dir, max_to_keep=1)
        else:
            raise ValueError(f"checkpoint_or_checkpoint_manager must be an ms.Checkpoint or "
                             f"ms.CheckpointManager, got {type(target).__name__}")
        self._cluster_resolver = cluster_resolver
        self._config = termination_config or TerminationConfig()
        self._counter = _RunCounter()
        checkpoint = self._manager.checkpoint
        checkpoint.preemption = self._counter
        self.restored_from = self._manager.latest_checkpoint
        if self.restored_from is not None:
            checkpoint.restore(self.restored_from).expect_partial()

        world = get_world()
        self._rank, self._size = world.rank, world.size
        self._comm = world.new_comm("mpistrat-preemption")
        self._send = np.zeros(2, dtype=np.int64)
        self._recv = np.zeros(2, dtype=np.int64)
        self._request: Optional[MPI.Request] = None
        self._signal = 0                 # the signal this rank received (0: none)
        self._signal_time: Optional[float] = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in WATCHED_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        if self._config.termination_watcher_fn is not None:
            threading.Thread(target=self._watch, name="mpistrat-preemption-watcher",
                             daemon=True).start()
        atexit.register(self._drain)

    # -- public API --------------------------------------------------------
    @property
    def total_run_calls(self) -> int:
        """How many ``run`` calls completed, over all restarts of the job."""
        return self._counter.value

    def run(self, distributed_train_function: Callable, *args, **kwargs):
        """Save and exit first if a preemption was agreed; else call the function and count it.

        Every rank must call ``run`` once per step (it is a step boundary). When a dataset
        iterator is in the checkpoint, take the batch *inside* the function
        (``handler.run(lambda: strategy.run(step, args=(next(it),)))``): a batch taken before
        ``run`` would be counted in the saved position without having been trained on.
        """
        self._boundary()
        result = distributed_train_function(*args, **kwargs)
        self._counter.value += 1
        return result

    def save_checkpoint_if_preempted(self, *args, **kwargs) -> None:
        """A step boundary without a function: save and exit if a preemption was agreed.

        For loops that do not go through ``run`` (TensorFlow's TPU usage); arguments are
        passed to ``CheckpointManager.save``. It does not change ``total_run_calls``.
        """
        self._boundary(*args, **kwargs)

    @contextmanager
    def watch_preemption_scope(self):
        """The region in which ``save_checkpoint_if_preempted`` is called (as in TensorFlow).

        On leaving it the last flag exchange is completed, so no MPI request is left open.
        """
        try:
            yield
        finally:
            if sys.exc_info()[0] is None:
                self._drain()

    # -- signals -----------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if not self._signal:
            self._signal, self._signal_time = int(signum), time.monotonic()

    def _watch(self) -> None:
        while not self._signal:
            try:
                if self._config.termination_watcher_fn():
                    self._on_signal(int(signal.SIGTERM), None)
                    return
            except Exception as err:  # a broken watcher must not end training silently
                sys.stderr.write(f"[mpistrat rank {self._rank}] termination_watcher_fn "
                                 f"raised {err!r}; it is no longer polled\n")
                return
            time.sleep(1.0)

    # -- agreement -----------------------------------------------------------
    def _boundary(self, *save_args, **save_kwargs) -> None:
        agreed = self._complete()
        if agreed is not None:
            self._save_and_exit(*agreed, save_args, save_kwargs)
        # flag: the signal number, and -rank so that MAX finds the lowest signalled rank
        self._send[:] = (self._signal, -self._rank if self._signal else -self._size)
        self._request = self._comm.Iallreduce(self._send, self._recv, op=MPI.MAX)

    def _complete(self):
        """Finish the exchange of the previous boundary: ``(signal, rank)`` or ``None``."""
        if self._request is None:
            return None
        self._request.Wait()
        self._request = None
        signum, first = int(self._recv[0]), int(-self._recv[1])
        return (signum, first) if signum else None

    def _drain(self) -> None:
        if self._request is not None and not MPI.Is_finalized():
            self._complete()

    def _save_and_exit(self, signum: int, first_rank: int, save_args, save_kwargs) -> None:
        step = self.total_run_calls
        if self._config.save_fn is not None:
            self._config.save_fn()
            where = "by save_fn"
        else:
            where = self._manager.save(*save_args, **save_kwargs)
            self._manager.sync()
        late = ""
        grace = self._config.grace_period
        if grace and self._signal_time is not None and \
                time.monotonic() - self._signal_time > grace:
            late = f" (after the grace period of {grace} s: the save may have been cut short)"
        if self._rank == 0:
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            sys.stdout.write(f"[mpistrat] {name} on rank {first_rank}: every rank saved at step "
                             f"{step}: {where}{late}; exiting with {PREEMPTED_EXIT_CODE} so the "
                             f"job can be requeued\n")
        sys.stdout.flush()
        sys.stderr.flush()
        if self._config.exit_fn is None:
            sys.exit(PREEMPTED_EXIT_CODE)
        self._config.exit_fn()
        self._signal, self._signal_time = 0, None  # an exit_fn that returns: training goes on


# ms.distribute.experimental gets these names here, so layer 3 never imports layer 5.
_experimental.PreemptionCheckpointHandler = PreemptionCheckpointHandler
_experimental.TerminationConfig = TerminationConfig
