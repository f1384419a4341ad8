"""``ms.CheckpointManager``: numbered checkpoints in a directory, the oldest deleted.

    >>> import numpy as np, tempfile, mpistrat as ms
    >>> step = ms.Variable(np.int64(0))
    >>> manager = ms.CheckpointManager(ms.Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
    >>> for _ in range(3):
    ...     _ = step.assign_add(1); _ = manager.save()
    >>> [p.rsplit("/", 1)[1] for p in manager.checkpoints]
    ['ckpt-2', 'ckpt-3']
"""

import os
import time
from typing import Callable, Dict, List, Optional

from mpistrat.checkpoint.checkpoint import Checkpoint, CheckpointOptions
from mpistrat.checkpoint.files import data_file, remove_checkpoint
from mpistrat.checkpoint.state_file import CheckpointState, read_state, write_state

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Save ``checkpoint`` as ``directory/checkpoint_name-N``, keeping ``max_to_keep``.

    ``keep_checkpoint_every_n_hours`` preserves one checkpoint per period from
    deletion; ``step_counter`` with ``checkpoint_interval`` makes ``save`` skip
    until that many steps have passed. The list is reloaded from the state
    file when the manager is created.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: Optional[int],
                 keep_checkpoint_every_n_hours: Optional[float] = None,
                 checkpoint_name: str = "ckpt", step_counter=None,
                 checkpoint_interval: Optional[int] = None, init_fn: Optional[Callable] = None):
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("checkpoint_interval needs a step_counter")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
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
        state = read_state(self._directory)
        self._kept: Dict[str, float] = {}
        self._last_preserved = time.time()
        if state is not None:
            self._last_preserved = state.last_preserved_timestamp or self._last_preserved
            times = state.all_model_checkpoint_timestamps
            for index, name in enumerate(state.all_model_checkpoint_paths):
                path = name if os.path.isabs(name) else os.path.join(self._directory, name)
                if os.path.isfile(data_file(path)):
                    self._kept[path] = times[index] if index < len(times) else time.time()

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoints(self) -> List[str]:
        """The kept checkpoints, oldest first."""
        return list(self._kept)

    @property
    def latest_checkpoint(self) -> Optional[str]:
        """The newest kept checkpoint, or ``None``."""
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
            self._last_saved_step = step
        self._checkpoint.sync()
        self._checkpoint.save_counter.assign_add(1)
        number = int(checkpoint_number) if checkpoint_number is not None \
            else int(self._checkpoint.save_counter.numpy())
        path = f"{self._prefix}-{number}"
        self._kept.pop(path, None)
        self._kept[path] = time.time()
        deleted = self._sweep()
        self._checkpoint._write(path, options, on_commit=lambda: self._commit(path, deleted))
        return path

    def _sweep(self) -> List[str]:
        """Drop the oldest entries beyond ``max_to_keep`` from the list; return those to delete."""
        deleted = []
        while self._max_to_keep is not None and len(self._kept) > self._max_to_keep:
            path, stamp = next(iter(self._kept.items()))
            del self._kept[path]
            if self._keep_seconds and stamp - self._last_preserved >= self._keep_seconds:
                self._last_preserved = stamp  # preserved: left on disk, no longer listed
                continue
            deleted.append(path)
        return deleted

    def _commit(self, path: str, deleted: List[str]) -> None:
        """On rank 0, once ``path`` is complete: state file first, then deletions."""
        names = [os.path.relpath(p, self._directory) for p in self._kept]
        write_state(self._directory, CheckpointState(
            os.path.relpath(path, self._directory), names, list(self._kept.values()),
            self._last_preserved))
        for old in deleted:
            remove_checkpoint(old)

    def restore_or_initialize(self) -> Optional[str]:
        """Restore the latest checkpoint and return its path, else run ``init_fn``."""
        if self.latest_checkpoint is not None:
            self._checkpoint.restore(self.latest_checkpoint)
            return self.latest_checkpoint
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Wait for an async save."""
        self._checkpoint.sync()
