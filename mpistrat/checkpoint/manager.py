"""``ms.CheckpointManager``: numbered checkpoints in a directory, the oldest deleted.

    >>> import numpy as np, tempfile, mpistrat as ms
    >>> step = ms.Variable(np.int64(0))
    >>> manager = ms.CheckpointManager(ms.Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
    >>> for _ in range(3):
    ...     _ = step.assign_add(1); _ = manager.save()
    >>> [p.rsplit("/", 1)[1] for p in manager.checkpoints]
    ['ckpt-2', 'ckpt-3']

With a directory first and no checkpoint object, the same name is Orbax's manager
(``orbax_manager.OrbaxCheckpointManager``): ``ms.CheckpointManager(directory,
options=ms.CheckpointManagerOptions(max_to_keep=3))``.
"""

import os
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

from mpistrat.checkpoint import writer
from mpistrat.checkpoint.checkpoint import Checkpoint, CheckpointOptions
from mpistrat.checkpoint.directory import agreed_state, io_engine
from mpistrat.checkpoint.files import check_checkpoint_name, remove_checkpoint
from mpistrat.checkpoint.state_file import CheckpointState, write_state

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Save ``checkpoint`` as ``directory/checkpoint_name-N``, keeping ``max_to_keep``.

    ``keep_checkpoint_every_n_hours`` preserves one checkpoint per period from
    deletion; ``step_counter`` with ``checkpoint_interval`` makes ``save`` skip
    until that many steps have passed. ``checkpoint_name`` is one file name
    (``"model ckpt"`` and ``"模型"`` are fine; ``"best/ckpt"`` is a ``ValueError``:
    put sub-directories in ``directory``). The list is reloaded from the state
    file when the manager is made (collectively: ranks that see different
    directories raise together). Only names inside the directory are trusted,
    and only files this library wrote are ever deleted. A failed save changes
    nothing: the list, the state file and ``save_counter`` stay as they were.

    Called with a path first (``str`` or ``os.PathLike``) or with only ``directory=`` and no
    ``checkpoint``, it makes Orbax's manager instead, an ``OrbaxCheckpointManager``:

        >>> import tempfile, mpistrat as ms
        >>> type(ms.CheckpointManager(tempfile.mkdtemp())).__name__
        'OrbaxCheckpointManager'
    """

    def __new__(cls, *args, **kwargs):
        if cls is CheckpointManager and "checkpoint" not in kwargs and (
                isinstance(args[0], (str, os.PathLike)) if args else "directory" in kwargs):
            from mpistrat.checkpoint.orbax_manager import OrbaxCheckpointManager
            return OrbaxCheckpointManager(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: Optional[int],
                 keep_checkpoint_every_n_hours: Optional[float] = None,
                 checkpoint_name: str = "ckpt", step_counter=None,
                 checkpoint_interval: Optional[int] = None, init_fn: Optional[Callable] = None):
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("checkpoint_interval needs a step_counter")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        check_checkpoint_name(checkpoint_name)
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._keep_seconds = (keep_checkpoint_every_n_hours * 3600.0
                              if keep_checkpoint_every_n_hours else None)
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_saved_step: Optional[int] = None
        latest, kept, preserved = agreed_state(self._directory, io_engine())
        self._kept: Dict[str, float] = {os.path.join(self._directory, n): t for n, t in kept}
        if latest is not None:  # the latest comes last, as in the state file TensorFlow writes
            path = os.path.join(self._directory, latest)
            self._kept[path] = self._kept.pop(path, time.time())
        self._last_preserved = preserved or time.time()

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoints(self) -> List[str]:
        """The kept checkpoints, oldest first (after the save in flight, if any)."""
        writer.wait_idle()
        return list(self._kept)

    @property
    def latest_checkpoint(self) -> Optional[str]:
        """The newest kept checkpoint, or ``None`` (after the save in flight, if any)."""
        writer.wait_idle()
        return list(self._kept)[-1] if self._kept else None

    @property
    def checkpoint_interval(self) -> Optional[int]:
        return self._interval

    def save(self, checkpoint_number=None, check_interval: bool = True,
             options: Optional[CheckpointOptions] = None) -> Optional[str]:
        """Write a new checkpoint; ``None`` when ``checkpoint_interval`` says not yet."""
        if self._interval is not None and check_interval:
            step = int(self._step_counter)
            if self._last_saved_step is not None and step < self._last_saved_step + self._interval:
                return None
        self._checkpoint.sync()
        counter = self._checkpoint.save_counter
        previous = int(counter.numpy())
        counter.assign_add(1)
        number = int(checkpoint_number) if checkpoint_number is not None else previous + 1
        path = f"{self._prefix}-{number}"
        writer.wait_idle()
        kept = dict(self._kept)
        kept.pop(path, None)
        kept[path] = time.time()
        kept, deleted, preserved = self._sweep(kept)
        step = int(self._step_counter) if self._interval is not None else None

        def on_success():  # every rank, once the save is complete and agreed
            self._kept, self._last_preserved = kept, preserved
            if step is not None:
                self._last_saved_step = step

        self._checkpoint._write(path, options,
                                on_commit=lambda: self._commit(path, kept, preserved, deleted),
                                on_success=on_success,
                                on_failure=lambda: counter.assign(previous))
        return path

    def _sweep(self, kept: Dict[str, float]) -> Tuple[Dict[str, float], List[str], float]:
        """Drop the oldest beyond ``max_to_keep``; return the list, those to delete, preserved."""
        deleted, preserved = [], self._last_preserved
        while self._max_to_keep is not None and len(kept) > self._max_to_keep:
            path, stamp = next(iter(kept.items()))
            del kept[path]
            if self._keep_seconds and stamp - preserved >= self._keep_seconds:
                preserved = stamp  # preserved: left on disk, no longer listed
                continue
            deleted.append(path)
        return kept, deleted, preserved

    def _commit(self, path: str, kept: Dict[str, float], preserved: float,
                deleted: List[str]) -> None:
        """On rank 0, once ``path`` is complete: state file first, then deletions of our files."""
        names = [os.path.basename(p) for p in kept]
        write_state(self._directory, CheckpointState(os.path.basename(path), names,
                                                     list(kept.values()), preserved))
        for old in deleted:
            remove_checkpoint(old)

    def restore_or_initialize(self) -> Optional[str]:
        """Restore the latest checkpoint and return its path, else run ``init_fn``."""
        latest = self.latest_checkpoint
        if latest is not None:
            status = self._checkpoint.restore(latest)
            _report_unrestored(status, latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Wait for an async save."""
        self._checkpoint.sync()


def _report_unrestored(status, path: str) -> None:
    """Warn (rank 0) about objects that exist now and got no value from ``path``: they keep
    their initial values. After a change of structure (a layer inserted before others,
    whose positional paths then shift) these are where the resumed values did not go."""
    missing = sorted(status.missing_objects - {"save_counter"})
    if not missing or io_engine().rank != 0:
        return
    shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10
                                        else "")
    warnings.warn(f"restore_or_initialize: {path} has no value for {shown}, which keep their "
                  f"initial values; if the objects' structure changed since the save (a layer "
                  f"inserted or models built in another order), values may have gone to other "
                  f"objects: compare status.missing_objects and status.unmatched_values of "
                  f"Checkpoint.restore, or call assert_existing_objects_matched()",
                  stacklevel=3)
