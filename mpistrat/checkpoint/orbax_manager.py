"""The Orbax face of ``ms.CheckpointManager``: steps in a directory, pytrees saved by ``args``.

``ms.CheckpointManager(directory, options=ms.CheckpointManagerOptions(...))`` (a path first,
no checkpoint object) makes an ``OrbaxCheckpointManager``; ``ms.CheckpointManager(checkpoint,
directory, max_to_keep)`` is TensorFlow's, unchanged. Saves and restores are collective, as
every mpistrat checkpoint: all ranks call them with the same step and the same values.
``all_steps``, ``latest_step`` and ``should_save`` answer from the list agreed when the manager
was made (``reload`` reads the directory again) and the saves since: they are pure, so ranks
may call them alone.

    >>> import numpy as np, tempfile, mpistrat as ms
    >>> from mpistrat.checkpoint import args
    >>> options = ms.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=10)
    >>> with ms.CheckpointManager(tempfile.mkdtemp(), options=options) as mngr:
    ...     for step in range(35):
    ...         _ = mngr.save(step, args=args.StandardSave({"w": np.full(2, step), "step": step}))
    ...     print(mngr.all_steps(), mngr.restore(None))
    [20, 30] {'step': 30, 'w': array([30, 30])}
"""

import os
import pathlib
import secrets
import warnings
from typing import Any, Dict, List, Optional

from mpi4py import MPI

from mpistrat.checkpoint import writer
from mpistrat.checkpoint.args import (CheckpointArgs, Composite, PyTreeRestore, PyTreeSave,
                                      StandardRestore, StandardSave, refuse)
from mpistrat.checkpoint.directory import io_engine, prepare_directory
from mpistrat.checkpoint.files import data_file, local_view
from mpistrat.checkpoint.h5write import write_file
from mpistrat.checkpoint.orbax_options import (CheckpointManagerOptions, StepAlreadyExistsError,
                                               check_step, retained, should_save)
from mpistrat.checkpoint.orbax_restore import agreed, agreed_manifest, read_item
from mpistrat.checkpoint.orbax_steps import (MANIFEST, check_item_name, commit, delete_step,
                                             foreign_hint, remove_stale, scan, step_dir,
                                             temp_dir, write_manifest)
from mpistrat.checkpoint.orbax_tree import describe
from mpistrat.collectives.agreement import agree_view
from mpistrat.collectives.objects import broadcast_object
from mpistrat.errors import DataLossError, NotFoundError

__all__ = ["CheckpointManagerOptions", "OrbaxCheckpointManager", "StepAlreadyExistsError"]


def _restore_arg(arg: Any):
    """``(target, partial)`` of one item's restore argument."""
    if arg is None:
        return None, False
    if isinstance(arg, (StandardRestore, PyTreeRestore)):
        return arg.item, bool(arg.partial_restore)
    if isinstance(arg, (StandardSave, PyTreeSave)):
        raise ValueError(f"{type(arg).__name__} is for save; restore with StandardRestore")
    raise ValueError(f"expected args of type StandardRestore or PyTreeRestore, found "
                     f"{type(arg).__qualname__}")


def _delete_quietly(directory: str, steps: List[int]) -> None:
    """Delete old steps after a save (rank 0); clean-up never fails a save: it warns."""
    for old in steps:
        try:
            delete_step(directory, old)
        except OSError as err:
            warnings.warn(f"could not delete checkpoint step {old} in {directory}: {err}",
                          RuntimeWarning, stacklevel=2)


class OrbaxCheckpointManager:
    """Orbax's ``CheckpointManager`` over mpistrat's checkpoints (``ms.CheckpointManager`` with
    a directory first). ``save(step, args=StandardSave(tree))`` writes ``DIR/<step>/``;
    ``restore(step)`` returns the tree as saved, ``restore(step, args=StandardRestore(target))``
    one shaped like ``target``. ``checkpointers``, ``metadata``, ``item_handlers``, ``logger``
    and ``handler_registry``: ``OrbaxNotSupportedError``; ``item_names`` declares the
    multi-item (``Composite``) mode.

        >>> import tempfile, mpistrat as ms
        >>> mngr = ms.CheckpointManager(tempfile.mkdtemp())
        >>> type(mngr).__name__, mngr.latest_step(), mngr.should_save(0)
        ('OrbaxCheckpointManager', None, True)
    """

    def __init__(self, directory, checkpointers=None,
                 options: Optional[CheckpointManagerOptions] = None, metadata=None,
                 item_names=None, item_handlers=None, logger=None, handler_registry=None,
                 **others: Any):
        if others:
            raise TypeError(f"unexpected arguments {sorted(others)}: the Orbax face takes "
                            f"options=ms.CheckpointManagerOptions(max_to_keep=...); TensorFlow's "
                            f"takes ms.CheckpointManager(checkpoint, directory, max_to_keep)")
        if checkpointers is not None and hasattr(checkpointers, "save_counter"):
            raise TypeError("a Checkpoint goes first: ms.CheckpointManager(checkpoint, "
                            "directory, max_to_keep) (TensorFlow's order)")
        for name, value in (("checkpointers", checkpointers), ("metadata", metadata),
                            ("item_handlers", item_handlers), ("logger", logger),
                            ("handler_registry", handler_registry)):
            if value is not None:
                refuse(f"CheckpointManager({name}=...)", "Orbax's handlers, loggers and "
                       "global metadata", "pass pytrees through args=StandardSave(...)")
        if options is None:
            options = CheckpointManagerOptions()
        if not isinstance(options, CheckpointManagerOptions):
            raise TypeError(f"options must be ms.CheckpointManagerOptions, got "
                            f"{type(options).__qualname__}")
        self._options, self._directory = options, os.fspath(directory)
        self._single: Optional[bool] = None if item_names is None else False
        for name in item_names or ():
            check_item_name(name)
        self._engine = io_engine()
        self._job: Optional[writer.Job] = None
        self._before: List[int] = []
        if options.create:
            writer.wait_idle()
            with self._engine.agreed(f"creating {self._directory}"):
                if self._engine.rank == 0:
                    os.makedirs(self._directory, exist_ok=True)
        self._steps = self._agreed_scan(self._directory)

    # -- what is there ---------------------------------------------------------------
    @property
    def directory(self) -> pathlib.Path:
        return pathlib.Path(self._directory)

    def all_steps(self, read: bool = False) -> List[int]:
        """The complete steps, ascending (``read=True``: read the directory again, collective)."""
        if read:
            self.reload()
        return list(self._steps)

    def latest_step(self) -> Optional[int]:
        """The newest step, or ``None`` when there is none."""
        return self._steps[-1] if self._steps else None

    def best_step(self) -> Optional[int]:
        """``latest_step()`` (``best_fn`` is not supported)."""
        return self.latest_step()

    def reload(self) -> None:
        """Read the directory's steps again (collective)."""
        self.wait_until_finished()
        self._steps = self._agreed_scan(self._directory)

    def _agreed_scan(self, directory: str) -> List[int]:
        writer.wait_idle()
        steps, unknown = scan(directory)
        agree_view(self._engine, steps, f"the steps of checkpoint directory {directory}")
        if unknown and self._engine.rank == 0:
            warnings.warn(f"{directory}: ignored numbered directories that are not complete "
                          f"mpistrat checkpoints: {unknown[:10]}", RuntimeWarning, stacklevel=3)
        return steps

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would write (pure): a step after the latest, and
        ``should_save_fn``, or a multiple of ``save_interval_steps``, a step in
        ``save_on_steps``, or the first save of an empty directory."""
        return should_save(self._options, check_step(step), self.latest_step())

    def reached_preemption(self, step: int) -> bool:
        refuse("CheckpointManager.reached_preemption", "JAX's preemption sync points",
               "use ms.distribute.experimental.PreemptionCheckpointHandler")

    def item_metadata(self, step: int):
        refuse("CheckpointManager.item_metadata", "Orbax's metadata trees",
               "restore(step) returns the saved tree")

    def metadata(self, step: Optional[int] = None):
        refuse("CheckpointManager.metadata", "Orbax's metadata trees",
               "restore(step) returns the saved tree")

    def metrics(self, step: int):
        refuse("CheckpointManager.metrics", "metrics kept with each step (best_fn)")

    # -- saving --------------------------------------------------------------------
    def _mode(self, single: bool) -> None:
        if self._single is None:
            self._single = single
        elif self._single != single:
            raise ValueError("Cannot provide `args` of type `Composite` when dealing with a "
                             "single, unnamed (default) checkpointable object." if single is False
                             else "Must provide `args` of type `Composite` when dealing with "
                             "multiple checkpointable objects.")

    def save(self, step: int, items=None, save_kwargs=None, metrics=None, force: bool = False,
             args: Optional[CheckpointArgs] = None, custom_metadata=None) -> bool:
        """Save ``args`` (``StandardSave(tree)``, or ``Composite(name=StandardSave(...))``) as
        step ``step`` if ``should_save(step)`` (or ``force``); ``True`` if it saved. Collective.
        Then the oldest steps beyond ``max_to_keep`` are deleted. ``metrics`` are ignored (as
        Orbax does without ``best_fn``)."""
        if items is not None or save_kwargs is not None:
            refuse("CheckpointManager.save(items=...)", "Orbax's legacy API",
                   "pass args=StandardSave(tree)")
        if custom_metadata is not None:
            refuse("CheckpointManager.save(custom_metadata=...)", "per-step metadata")
        if args is None:
            raise ValueError("Must provide `args` for `save`.")
        if isinstance(args, Composite):
            wanted, single = dict(args), False
        elif isinstance(args, (StandardSave, PyTreeSave)):
            wanted, single = {"default": args}, True
        else:
            raise ValueError(f"expected args of type StandardSave, PyTreeSave or Composite, "
                             f"found {type(args).__qualname__}")
        self._mode(single)
        step = check_step(step)
        if not force and not self.should_save(step):
            return False
        self.wait_until_finished()
        if step in self._steps:
            raise StepAlreadyExistsError(f"Checkpoint for step {step} already exists.")
        asynchronous = self._options.enable_async_checkpointing and \
            MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        described = {}
        with agreed(self._engine, f"saving step {step} in {self._directory}"):
            for name, arg in sorted(wanted.items()):
                if not isinstance(arg, (StandardSave, PyTreeSave)):
                    raise ValueError(f"item {name!r}: expected StandardSave or PyTreeSave, "
                                     f"found {type(arg).__qualname__}")
                described[check_item_name(name)] = describe(arg.item, copy=asynchronous)
            folded = sorted(described, key=str.lower)
            for a, b in zip(folded, folded[1:]):
                if a.lower() == b.lower():   # one file where case is folded (macOS, CIFS)
                    raise ValueError(f"items {a!r} and {b!r} differ only in case: an item is "
                                     f"a file, so their names must differ otherwise")
        final = step_dir(self._directory, step)
        if agree_view(self._engine, local_view(final), final, error=DataLossError) != "missing":
            raise StepAlreadyExistsError(f"{final} already exists{foreign_hint(final)}; "
                                         f"mpistrat never writes over it")
        self._before = list(self._steps)
        self._steps, deleted = retained(self._options, self._steps, step)

        def run():
            self._write(step, single, described, deleted)

        if asynchronous:
            self._job = writer.start(run, f"step {step} in {self._directory}")
            return True
        try:
            run()
        except BaseException:
            self._steps = self._before
            raise
        return True

    def _write(self, step: int, single: bool, described: Dict[str, tuple],
               deleted: List[int]) -> None:
        engine, directory = self._engine, self._directory
        what = f"saving step {step} in {directory}"
        if not self._options.create and \
                agree_view(engine, local_view(directory), directory) != "dir":
            raise NotFoundError(f"{what}: the directory does not exist (create=False)")
        token = broadcast_object(engine, secrets.token_hex(16) if engine.rank == 0 else None,
                                 0, f"{what}: the token")
        temp, final = temp_dir(directory, step, token), step_dir(directory, step)
        if engine.rank == 0:
            remove_stale(directory)
        try:
            prepare_directory(temp, engine, os.path.join(temp, MANIFEST))
            for name, (_, values, kinds) in sorted(described.items()):
                write_file(data_file(os.path.join(temp, name)), values, kinds, engine)
            with engine.agreed(what, doing=f"committing {final}"):
                if engine.rank == 0:
                    write_manifest(temp, step, single, {n: d[0] for n, d in described.items()})
                    commit(temp, final, directory)
                    _delete_quietly(directory, deleted)   # (no rank goes on while it deletes)
        except BaseException:
            if engine.rank == 0:
                remove_stale(directory)     # our temporary directory, if it holds only ours
            raise
        agree_view(engine, local_view(os.path.join(final, MANIFEST)), final)

    def is_saving_in_progress(self) -> bool:
        """Whether an asynchronous save of this manager is still being written."""
        return self._job is not None and self._job._thread.is_alive()

    def wait_until_finished(self) -> None:
        """Wait for this manager's asynchronous save; raise its error, if it failed (every
        rank does: errors of a save are agreed)."""
        job, self._job = self._job, None
        error = job.take_error() if job is not None else None
        if error is not None:
            self._steps = self._before
            raise error
        writer.wait_idle()        # (another object's save in flight uses the same engine)

    def delete(self, step: int) -> None:
        """Delete a step (collective); ``FileNotFoundError`` if it is not one."""
        self.wait_until_finished()
        step = check_step(step)
        if step not in self._steps:
            raise NotFoundError(f"Requested deleting a non-existent step: {step}.")
        with self._engine.agreed(f"deleting step {step} in {self._directory}"):
            if self._engine.rank == 0:
                delete_step(self._directory, step)
        self._steps.remove(step)

    def close(self) -> None:
        """Wait for the save in flight (``with`` does this on leaving)."""
        self.wait_until_finished()

    def __enter__(self) -> "OrbaxCheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restoring -----------------------------------------------------------------
    def restore(self, step: Optional[int], items=None, restore_kwargs=None, directory=None,
                args: Optional[CheckpointArgs] = None) -> Any:
        """The tree of step ``step`` (``None``: the latest; none: ``FileNotFoundError``).
        Without ``args``, as saved (NumPy arrays, Python numbers; a ``Composite`` of every
        item in the multi-item mode); with ``StandardRestore(target)``, a new tree shaped and
        typed like ``target`` (JAX arrays stay JAX arrays). Collective. A missing step:
        ``NotFoundError``; a directory that is not a complete mpistrat step, or a damaged
        file: ``DataLossError``; a target that does not fit: ``ValueError`` naming the path."""
        if items is not None or restore_kwargs is not None:
            refuse("CheckpointManager.restore(items=...)", "Orbax's legacy API",
                   "pass args=StandardRestore(target)")
        self.wait_until_finished()
        root = self._directory if directory is None else os.fspath(directory)
        if step is None:
            steps = self._steps if directory is None else self._agreed_scan(root)
            if not steps:
                raise NotFoundError(f"No steps found in {root}.")
            step = steps[-1]
        step = check_step(step)
        path = step_dir(root, step)
        manifest = agreed_manifest(self._engine, path, step)
        single = manifest["mode"] == "single"
        plan = {}
        with agreed(self._engine, f"restoring {path}"):
            if single and isinstance(args, Composite):
                raise ValueError("Cannot provide `args` of type `Composite` when dealing with "
                                 "a single, unnamed (default) checkpointable object.")
            if not single and args is not None and not isinstance(args, Composite):
                raise ValueError("Must provide `args` of type `Composite` when dealing with "
                                 "multiple checkpointable objects.")
            chosen = {"default": args} if single else dict(args) if args is not None else \
                dict.fromkeys(manifest["items"])
            for name, arg in chosen.items():
                if name not in manifest["items"]:
                    raise ValueError(f"{path} has no item {name!r}; its items: "
                                     f"{sorted(manifest['items'])}")
                plan[name] = _restore_arg(arg)
        if directory is None and self._single is None:
            self._single = single
        restored = {name: read_item(self._engine, path, name, manifest["items"][name],
                                    *plan[name])
                    for name in sorted(plan)}
        return restored["default"] if single else Composite(**restored)
