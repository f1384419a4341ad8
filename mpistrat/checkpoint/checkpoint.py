"""``ms.Checkpoint``: save and restore tracked state in HDF5, as ``tf.train.Checkpoint``.

Every call is collective: all ranks save and restore together.

    >>> import numpy as np, tempfile, mpistrat as ms
    >>> class Model: pass
    >>> model = Model(); model.kernel = ms.Variable(np.ones(3))
    >>> ckpt = ms.Checkpoint(model=model)
    >>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")      # .../ckpt-1
    >>> model.kernel.assign(np.zeros(3)) is not None
    True
    >>> ckpt.restore(path).assert_consumed() is not None
    True
    >>> model.kernel.numpy().tolist()
    [1.0, 1.0, 1.0]
"""

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint.files import data_file, remove_leftovers, resolve
from mpistrat.checkpoint.graph import Slot, check_segment, collect_slots
from mpistrat.checkpoint.h5format import gather_errors, parallel_available, read_file, write_file
from mpistrat.checkpoint.state_file import CheckpointState, read_state, write_state
from mpistrat.collectives import CollectiveEngine
from mpistrat.distribute.variables import Variable
from mpistrat.runtime import get_world

__all__ = ["Checkpoint", "CheckpointOptions", "CheckpointLoadStatus", "latest_checkpoint"]


@dataclass(frozen=True)
class CheckpointOptions:
    """``enable_async=True``: ``save`` returns once values are copied to host memory."""

    enable_async: bool = False
    experimental_io_device: Optional[str] = None
    experimental_enable_async_checkpoint: bool = False

    @property
    def asynchronous(self) -> bool:
        return self.enable_async or self.experimental_enable_async_checkpoint


_IO_ENGINE: list = []


def _io_engine() -> CollectiveEngine:
    """The checkpoint engine, on its own communicator (so async writes never meet training)."""
    if not _IO_ENGINE:
        _IO_ENGINE.append(CollectiveEngine(get_world().new_comm("mpistrat-checkpoint")))
    return _IO_ENGINE[0]


class CheckpointLoadStatus:
    """What a restore matched; the ``assert_*`` methods raise ``AssertionError``."""

    def __init__(self, path: str, matched, unmatched_values, missing_objects):
        self.path = path
        self.matched = set(matched)
        self.unmatched_values = set(unmatched_values)  # in the file, no object (yet)
        self.missing_objects = set(missing_objects)    # objects with no value in the file

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Every value in the file found its object, and every object its value."""
        if self.unmatched_values:
            raise AssertionError(f"{self.path}: values with no object to restore into: "
                                 f"{sorted(self.unmatched_values)}")
        return self.assert_existing_objects_matched()

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Every object now tracked got a value from the file."""
        if self.missing_objects:
            raise AssertionError(f"{self.path}: objects without a value in the checkpoint: "
                                 f"{sorted(self.missing_objects)}")
        return self

    def assert_nontrivial_match(self) -> "CheckpointLoadStatus":
        """At least one object other than the save counter was restored."""
        if not self.matched - {"save_counter"}:
            raise AssertionError(f"{self.path}: nothing but the save counter was restored")
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Accept a partial restore (nothing is warned about here)."""
        return self

    def run_restore_ops(self, session=None) -> None:
        """Restores happen eagerly; kept for compatibility."""


class InitializationOnlyStatus(CheckpointLoadStatus):
    """The status of ``restore(None)``: nothing was restored."""

    def __init__(self):
        super().__init__("(no checkpoint)", (), (), ())

    def assert_consumed(self):
        raise AssertionError("no checkpoint was restored (restore(None))")

    assert_existing_objects_matched = assert_nontrivial_match = assert_consumed


class Checkpoint:
    """Tracks objects given as keyword arguments (or attributes set later) and saves them."""

    def __init__(self, root: Any = None, **kwargs: Any):
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_pending", {})   # path -> value, for objects attached later
        object.__setattr__(self, "_status", None)
        object.__setattr__(self, "_async", None)   # (thread, error box) of a save in flight
        counter = Variable(np.int64(0), name="save_counter")
        counter._strategy = None  # a local counter: every rank counts the same saves
        object.__setattr__(self, "save_counter", counter)
        for name, value in kwargs.items():
            setattr(self, name, value)

    # -- tracking ------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name.startswith("_") or name == "save_counter":
            return
        self._children[check_segment(name)] = value
        if self._pending:
            self._apply_pending({name: value})

    def _named(self) -> Dict[str, Any]:
        named = {}
        if self._root is not None:
            root = self._root
            children = root if isinstance(root, dict) else (
                root._checkpoint_children() if hasattr(root, "_checkpoint_children")
                else {k: v for k, v in vars(root).items() if not k.startswith("_")})
            named.update(children)
        named.update(self._children)
        named["save_counter"] = self.save_counter
        return named

    def _assign(self, name: str, value: Any) -> None:
        """Put back a restored top-level number, on the root or on the checkpoint."""
        root = self._root
        if name not in self._children and isinstance(root, dict):
            root[name] = value
        elif name not in self._children and root is not None:
            setattr(root, name, value)
        else:
            object.__setattr__(self, name, value)
            self._children[name] = value

    def _checkpoint_children(self) -> Dict[str, Any]:
        """Lets a checkpoint be nested inside another one."""
        return self._named()

    # -- saving --------------------------------------------------------------
    def write(self, file_prefix: str, options: Optional[CheckpointOptions] = None) -> str:
        """Write a checkpoint at exactly ``file_prefix`` (no counter, no state file)."""
        return self._write(os.fspath(file_prefix), options)

    def save(self, file_prefix: str, options: Optional[CheckpointOptions] = None) -> str:
        """Increment ``save_counter``, write ``file_prefix-N``, update the state file."""
        self.sync()
        self.save_counter.assign_add(1)
        path = f"{os.fspath(file_prefix)}-{int(self.save_counter.numpy())}"
        return self._write(path, options, on_commit=lambda: _record_latest(path))

    def _write(self, path: str, options, on_commit=None) -> str:
        """Write ``path``; then ``on_commit()`` on rank 0 (in the writing thread)."""
        self.sync()
        engine = _io_engine()
        directory = os.path.dirname(path) or "."
        error = None
        if engine.rank == 0:
            try:
                os.makedirs(directory, exist_ok=True)
                remove_leftovers(directory)
            except OSError as err:
                error = f"rank 0 could not prepare {directory}: {err}"
        error = engine.broadcast_object(error)  # leftovers are gone before anyone writes
        if error:
            raise OSError(error)
        slots = collect_slots(self._named())
        asynchronous = options is not None and options.asynchronous
        # An async save stages a copy (training may change the values meanwhile).
        values = {p: np.array(s.read(), copy=asynchronous) for p, s in sorted(slots.items())}
        kinds = {p: s.kind for p, s in slots.items()}
        job = _SaveJob(path, values, kinds, engine, on_commit)
        if asynchronous:
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("async checkpoints need MPI_THREAD_MULTIPLE; this MPI "
                                   "was initialised with less")
            box: Dict[str, BaseException] = {}
            thread = threading.Thread(target=job.run_into, args=(box,), daemon=True,
                                      name=f"mpistrat-save {os.path.basename(path)}")
            object.__setattr__(self, "_async", (thread, box))
            thread.start()
        else:
            job.run()
        return path

    def sync(self) -> None:
        """Wait for an async save; raise its error, if it failed."""
        pending = self._async
        if pending is None:
            return
        object.__setattr__(self, "_async", None)
        thread, box = pending
        thread.join()
        if "error" in box:
            raise box["error"]

    # -- restoring -----------------------------------------------------------
    def read(self, save_path: str, options: Optional[CheckpointOptions] = None):
        """Restore a checkpoint written by ``write`` (or ``save``)."""
        return self.restore(save_path, options)

    def restore(self, save_path: Optional[str], options=None) -> CheckpointLoadStatus:
        """Restore values from ``save_path``; values for objects attached later wait for them.

        ``None`` restores nothing. Raises ``NotFoundError`` for a missing path,
        ``ValueError`` (naming the object path) for a shape or dtype mismatch,
        ``DataLossError`` for a corrupt file.
        """
        if save_path is None:
            return InitializationOnlyStatus()
        self.sync()
        final = resolve(save_path)
        values, kinds = read_file(final, _io_engine())
        slots = collect_slots(self._named(), self._assign)
        matched = self._apply(slots, values, final)
        pending = {p: v for p, v in values.items() if p not in matched}
        object.__setattr__(self, "_pending", pending)
        status = CheckpointLoadStatus(final, matched, pending, set(slots) - set(values))
        object.__setattr__(self, "_status", status)
        return status

    def _apply(self, slots: Dict[str, Slot], values: Dict[str, np.ndarray], source: str):
        matched, states = set(), {}
        for path in sorted(set(slots) & set(values)):
            slot, value = slots[path], values[path]
            _check_compatible(slot, value, path, source)
            if slot.kind == "state":
                states.setdefault(id(slot.owner), (slot.owner, {}))[1][path.rsplit("/", 1)[1]] = value
            elif slot.write is not None:
                slot.write(value)
            matched.add(path)
        for owner, tensors in states.values():
            owner._restore_from_tensors(tensors)
        return matched

    def _apply_pending(self, named: Dict[str, Any]) -> None:
        slots = collect_slots(named, self._assign)
        matched = self._apply(slots, self._pending, "the restored checkpoint")
        for path in matched:
            self._pending.pop(path, None)
        if self._status is not None:
            self._status.matched |= matched
            self._status.unmatched_values -= matched


def _check_compatible(slot: Slot, value: np.ndarray, path: str, source: str) -> None:
    owner = slot.owner
    if slot.kind in ("variable", "array"):
        shape, dtype = tuple(owner.shape), np.dtype(owner.dtype)
        if tuple(value.shape) != shape or value.dtype != dtype:
            raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds "
                             f"{value.dtype}{list(value.shape)}, the object is {dtype}{list(shape)}")


class _SaveJob:
    """The write of one checkpoint (in the caller's thread, or a background one)."""

    def __init__(self, path, values, kinds, engine, on_commit):
        self.path, self.values, self.kinds = path, values, kinds
        self.engine, self.on_commit = engine, on_commit

    def run(self) -> None:
        write_file(data_file(self.path), self.values, self.kinds, self.engine.comm, self.engine,
                   parallel_available())
        error = None
        if self.on_commit is not None and self.engine.rank == 0:
            try:
                self.on_commit()
            except Exception as err:  # noqa: BLE001 - shared with every rank below
                error = f"rank 0: updating the checkpoint state for {self.path}: {err}"
        errors = gather_errors(self.engine, error)
        if errors:  # the state file names the new checkpoint before anyone moves on
            raise OSError(errors[0])

    def run_into(self, box: Dict[str, BaseException]) -> None:
        try:
            self.run()
        except BaseException as err:  # noqa: BLE001 - surfaced by sync() or the next save
            box["error"] = err


def _record_latest(path: str) -> None:
    """Name ``path`` as the latest checkpoint, keeping the others listed."""
    directory, name = os.path.split(path)
    directory = directory or "."
    state = read_state(directory) or CheckpointState(name)
    times = dict(zip(state.all_model_checkpoint_paths, state.all_model_checkpoint_timestamps))
    times.pop(name, None)
    times[name] = time.time()
    write_state(directory, CheckpointState(name, list(times), list(times.values()),
                                           state.last_preserved_timestamp))


def latest_checkpoint(checkpoint_dir: str, latest_filename: Optional[str] = None) -> Optional[str]:
    """The path of the newest complete checkpoint in ``checkpoint_dir``, or ``None``."""
    state = read_state(os.fspath(checkpoint_dir))
    if state is None or not state.model_checkpoint_path:
        return None
    path = state.model_checkpoint_path
    if not os.path.isabs(path):
        path = os.path.join(os.fspath(checkpoint_dir), path)
    return path if os.path.isfile(data_file(path)) else None
