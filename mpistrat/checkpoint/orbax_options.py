"""Orbax's ``CheckpointManagerOptions`` and the rules it sets: when to save, what to keep.

Pure: ``should_save`` and ``retained`` decide from the agreed list of steps alone, so every
rank decides alike without a collective.

    >>> from mpistrat.checkpoint.orbax_options import CheckpointManagerOptions, retained
    >>> options = CheckpointManagerOptions(max_to_keep=2, keep_period=10)
    >>> retained(options, [10, 15, 20, 25], 30)
    ([10, 20, 25, 30], [15])
"""

import dataclasses
import operator
from typing import Any, Callable, Container, List, Optional, Tuple

from mpistrat.checkpoint.args import refuse

__all__ = ["CheckpointManagerOptions", "StepAlreadyExistsError", "check_step", "should_save",
           "retained"]

# options of Orbax's that change what is kept or where: refused unless left at the default
_REFUSED = ("keep_time_interval", "best_fn", "step_prefix", "step_format_fixed_length",
            "step_name_format", "single_host_load_and_broadcast", "todelete_subdir",
            "todelete_full_path", "read_only", "async_options", "multiprocessing_options",
            "file_options", "atomicity_options", "temporary_path_class", "save_decision_policy",
            "preservation_policy", "enable_per_process_directory_creation")


class StepAlreadyExistsError(ValueError):
    """``save`` of a step that is already in the directory (as Orbax's; a ``ValueError``).

        >>> issubclass(StepAlreadyExistsError, ValueError)
        True
    """


@dataclasses.dataclass
class CheckpointManagerOptions:
    """Orbax's ``CheckpointManagerOptions``, the same field names and defaults.

    Honoured: ``save_interval_steps`` (save when ``step % n == 0``; ``0`` or ``None``: only by
    the other rules), ``save_on_steps``, ``should_save_fn(step, last_step)``, ``max_to_keep``
    (``None``: keep all; at least 1), ``keep_period`` (steps that are multiples of it are never
    deleted), ``create``, ``enable_async_checkpointing`` (asynchronous when this MPI runs at
    ``MPI_THREAD_MULTIPLE``, else synchronous). Accepted without effect: ``best_mode``,
    ``keep_checkpoints_without_metrics``, ``cleanup_tmp_directories`` (our temporary step
    directories are always cleaned), ``enable_background_delete``, ``num_deletion_threads``,
    ``save_root_metadata``, ``prevent_write_metrics``,
    ``enable_should_save_is_saving_in_progress_check``, ``lightweight_initialize``. Any other
    option set: ``OrbaxNotSupportedError``.

        >>> CheckpointManagerOptions(max_to_keep=3).save_interval_steps
        1
    """

    save_interval_steps: Optional[int] = 1
    max_to_keep: Optional[int] = None
    keep_time_interval: Any = None
    keep_period: Optional[int] = None
    best_fn: Optional[Callable] = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: Optional[str] = None
    step_format_fixed_length: Optional[int] = None
    step_name_format: Any = None
    create: bool = True
    cleanup_tmp_directories: bool = False
    save_on_steps: Optional[Container[int]] = None
    single_host_load_and_broadcast: bool = False
    todelete_subdir: Optional[str] = None
    todelete_full_path: Optional[str] = None
    enable_background_delete: bool = False
    num_deletion_threads: Optional[int] = None
    read_only: bool = False
    enable_async_checkpointing: bool = True
    async_options: Any = None
    multiprocessing_options: Any = None
    should_save_fn: Optional[Callable[[int, Optional[int]], bool]] = None
    file_options: Any = None
    atomicity_options: Any = None
    save_root_metadata: bool = True
    temporary_path_class: Any = None
    save_decision_policy: Any = None
    preservation_policy: Any = None
    prevent_write_metrics: bool = False
    enable_should_save_is_saving_in_progress_check: bool = True
    enable_per_process_directory_creation: bool = False
    lightweight_initialize: bool = False

    def __post_init__(self):
        for name in _REFUSED:
            value = getattr(self, name)
            if value is not None and value is not False:
                refuse(f"CheckpointManagerOptions({name}=...)", "an Orbax option",
                       f"leave {name} at its default")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be None or at least 1, got {self.max_to_keep} "
                             f"(0 would delete the checkpoint just saved)")
        for name in ("save_interval_steps", "keep_period"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or operator.index(value) < 0):
                raise ValueError(f"{name} must be None or a non-negative integer, got {value!r}")


def check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"a step is an integer, got {step!r}")
    try:
        number = operator.index(step)
    except TypeError:
        raise TypeError(f"a step is an integer, got {type(step).__qualname__}") from None
    if number < 0:
        raise ValueError(f"a step is a non-negative integer, got {number}")
    return number




def should_save(options: CheckpointManagerOptions, step: int, last: Optional[int]) -> bool:
    """Orbax's rule: only a step after the ``last`` saved; then ``should_save_fn(step, last)``
    if given, else a multiple of ``save_interval_steps``, a step in ``save_on_steps``, or the
    first save when there is no step yet.

        >>> should_save(CheckpointManagerOptions(save_interval_steps=5), 7, None)
        True
        >>> should_save(CheckpointManagerOptions(save_interval_steps=5), 7, 5)
        False
    """
    if last is not None and last >= step:
        return False
    if options.should_save_fn is not None:
        return bool(options.should_save_fn(step, last))
    if options.save_interval_steps and step % options.save_interval_steps == 0:
        return True
    if options.save_on_steps is not None and step in options.save_on_steps:
        return True
    return last is None


def retained(options: CheckpointManagerOptions, steps: List[int],
             new: int) -> Tuple[List[int], List[int]]:
    """``(steps kept, steps to delete)`` once ``new`` is saved: the newest ``max_to_keep``
    (``new`` always), and multiples of ``keep_period``."""
    every = sorted(set(steps) | {new})
    keep, period = options.max_to_keep, options.keep_period
    kept = [s for s in every if keep is None or s == new or s in every[-keep:] or
            bool(period) and s % period == 0]
    return kept, [s for s in every if s not in kept]
