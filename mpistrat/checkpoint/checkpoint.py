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

What is saved, skipped and refused is ``graph.py``'s rule: ``save`` raises ``ValueError``
naming every value it cannot save, never writes a file that lacks one. Immutable values
(JAX arrays, tuples, optax states, Equinox modules) are rebuilt and rebound, so read them
back from where they are held (``ckpt.opt_state``), not from an old reference.

Restore-on-create. Values in the file whose objects do not exist yet stay *pending* (in
``status.unmatched_values``) until their objects appear anywhere in the graph. They are
applied, checked against the object first, when

1. an attribute is set on the ``Checkpoint`` (``ckpt.opt_state = tx.init(params)``);
2. Keras builds a layer or optimizer that the graph held unbuilt at the restore (a layer at
   its first call, an optimizer's slots at its first step or ``build``): a hook on its
   ``build`` applies them right after it returns, before any training step uses them;
3. ``status.apply_pending()``, ``assert_consumed()`` or ``assert_existing_objects_matched()``
   is called (objects attached deep inside another, such as a pytree set on a plain
   object after the restore: call ``apply_pending()`` before training on it).

A save never applies them (that would overwrite what training did since). They last until
the next restore of this checkpoint.
"""

import os
import weakref
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint import writer
from mpistrat.checkpoint.directory import (io_engine, latest_checkpoint, prepare_directory,
                                           record_latest, restore_target)
from mpistrat.checkpoint.formats import CheckpointReader, open_reader
from mpistrat.checkpoint.frameworks import install_build_hook
from mpistrat.checkpoint.files import data_file
from mpistrat.checkpoint.graph import (Slot, check_segment, collect_slots, in_symbolic_build,
                                       initial_values_only, required_paths, root_children)
from mpistrat.checkpoint.h5format import H5Writer
from mpistrat.checkpoint.status import (CheckpointLoadStatus, InitializationOnlyStatus,
                                        refuse_no_match)
from mpistrat.checkpoint.pytrees import as_saved, saved_kind
from mpistrat.checkpoint.matching import (agree_plan, check_compatible as _check_compatible,
                                          fit_to_slot)
from mpistrat.distribute.context import outside_strategies
from mpistrat.distribute.variables import Variable
from mpistrat.runtime import timeline

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


class Checkpoint:
    """Tracks objects given as keyword arguments (or attributes set later) and saves them."""

    def __init__(self, root: Any = None, **kwargs: Any):
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_pending", None)  # the reader of values for objects attached later
        object.__setattr__(self, "_status", None)
        object.__setattr__(self, "_async", None)   # this object's save in flight (writer.Job)
        with outside_strategies():  # a local counter: every rank counts the same saves
            counter = Variable(np.int64(0), name="save_counter")
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
            self._apply_pending()

    def _named(self) -> Dict[str, Any]:
        named = {}
        if self._root is not None:   # (a Keras model as root: its weights, not its flags)
            named.update(root_children(self._root))
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
        """Increment ``save_counter``, write ``file_prefix-N``, update the state file.

        If the save fails (on any rank), every rank raises the same error and
        ``save_counter``, the state file and the previous checkpoint are unchanged.
        """
        self.sync()
        previous = int(self.save_counter.numpy())
        self.save_counter.assign_add(1)
        path = f"{os.fspath(file_prefix)}-{previous + 1}"
        return self._write(path, options, on_commit=lambda: record_latest(path),
                           on_failure=lambda: self.save_counter.assign(previous))

    def _write(self, path: str, options, on_commit=None, on_success=None,
               on_failure=None) -> str:
        """Write ``path``; ``on_commit()`` on rank 0 once it is complete (before the others go
        on), then ``on_success()`` on every rank; ``on_failure()`` on every rank if it failed."""
        try:
            self.sync()
            writer.wait_idle()
            engine = io_engine()
            prepare_directory(os.path.dirname(path) or ".", engine, path)
            slots = _agreed_slots(self._named(), engine, path)
            asynchronous = options is not None and options.asynchronous
            if asynchronous and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("async checkpoints need MPI_THREAD_MULTIPLE; this MPI "
                                   "was initialised with less")
            # An async save stages a copy (training may change the values meanwhile).
            values = {p: np.array(s.read(), copy=asynchronous) for p, s in sorted(slots.items())}
            kinds = {p: saved_kind(s) for p, s in slots.items()}
        except BaseException:
            if on_failure is not None:
                on_failure()
            raise
        job = _SaveJob(path, values, kinds, engine, on_commit, on_success, on_failure)
        if asynchronous:
            object.__setattr__(self, "_async", writer.start(job.run, os.path.basename(path)))
        else:
            job.run()
        return path

    def sync(self) -> None:
        """Wait for this object's async save; raise its error, if it failed."""
        job = self._async
        if job is None:
            return
        object.__setattr__(self, "_async", None)
        error = job.take_error()
        if error is not None:
            raise error

    # -- restoring -----------------------------------------------------------
    def read(self, save_path: str, options: Optional[CheckpointOptions] = None):
        """Restore a checkpoint written by ``write`` (or ``save``)."""
        return self.restore(save_path, options)

    def restore(self, save_path: Optional[str], options=None) -> CheckpointLoadStatus:
        """Restore values from ``save_path``; values for objects attached later wait for them.

        ``None`` restores nothing. Raises ``NotFoundError`` for a missing path,
        ``ValueError`` (naming the object path) for a shape or dtype mismatch,
        ``DataLossError`` for a corrupt or crafted file; the same on every rank.
        The file is validated, and shapes compared with the objects, before
        any value is read. Values are then read, verified and applied in batches
        of about 64 MiB (so a restore needs little memory beyond the state): if
        a checksum fails in a later batch, the objects of earlier batches
        already hold the file's values; restore another checkpoint then.
        """
        if save_path is None:
            return InitializationOnlyStatus()
        self.sync()
        writer.wait_idle()
        engine = io_engine()
        reader = open_reader(restore_target(os.fspath(save_path)), engine)  # either format
        source, named = reader.source, self._named()
        slots = collect_slots(named, self._assign)
        found = reader.match(slots, named, self._root)  # ours -> the checkpoint's
        wanted = {name: reader.entry(found[name]) for name in sorted(found)}
        agree_plan(engine, slots, wanted, source,   # every rank raises, or none
                   reader.checker(named, slots, found, _check_compatible))
        reader.refuse(found)                       # (the same plan on every rank)
        matched, types = set(), reader.array_types(wanted)
        with timeline.span("checkpoint restore", "checkpoint", file=os.path.basename(source),
                           nbytes=sum(e.nbytes for e in wanted.values())), \
                closing(reader.read(wanted)) as batches:
            for batch in batches:  # read, verify, apply: old values freed as we go
                matched |= self._apply(slots, batch, source, types)
        # values without an object yet are read when one is attached (never before)
        reader.keep_pending({found[p] for p in matched})
        object.__setattr__(self, "_pending", reader)
        reader.hook_unbuilt(self, named)   # (objects the format binds beyond our walk)
        known = reader.known(found)
        status = CheckpointLoadStatus(source, matched, reader.paths(),
                                      reader.missing(slots, found), lambda: self._refresh(known))
        object.__setattr__(self, "_status", status)
        refuse_no_match(source, matched, status.missing_objects, reader.paths())
        self._hook_unbuilt(slots)
        return status

    def _apply(self, slots: Dict[str, Slot], values: Dict[str, np.ndarray], source: str,
               array_types: Optional[Dict[str, str]] = None):
        """Write ``values`` into their slots; a value counts as restored only once written
        (then immutable nodes are rebuilt and rebound: ``SlotMap.finish``). A Python number
        whose file value was saved from an array (``array_types``: path -> the array type,
        ``reader.array_types``) comes back as that array: types are restored as saved (a
        Flax ``TrainState.step`` saved as a JAX int32)."""
        matched, states = set(), {}
        for path in sorted(set(slots) & set(values)):
            slot, value = slots[path], values[path]
            _check_compatible(slot, value, path, source)
            value = fit_to_slot(slot, value)   # (an integer of another width that fits)
            if slot.kind == "state":
                states.setdefault(id(slot.owner), (slot.owner, {}))[1][path.rsplit("/", 1)[1]] = value
            elif slot.rebind is not None and array_types and path in array_types:
                slot.rebind(as_saved(value, array_types[path]))
            elif slot.write is not None:
                slot.write(value)
            else:
                continue
            matched.add(path)
        for owner, tensors in states.values():
            owner._restore_from_tensors(tensors)
        if hasattr(slots, "finish"):
            slots.finish()
        return matched

    # -- restore-on-create ---------------------------------------------------------
    def _hook_unbuilt(self, slots) -> None:
        """While values are pending, every framework object not built yet (a Keras layer,
        a Keras optimizer) restores them right after it is built."""
        if not self._pending or not getattr(slots, "unbuilt", None):
            return
        built = self._when_built()
        for obj in slots.unbuilt:
            install_build_hook(obj, id(self), built)

    def _when_built(self):
        """What a build hook runs: apply this checkpoint's pending values, if it still
        exists (the hook holds it weakly) and has any."""
        ref = weakref.ref(self)

        def built():
            checkpoint = ref()
            if checkpoint is not None and checkpoint._pending:
                checkpoint._apply_pending()
        return built

    def _refresh(self, saved):
        """Apply pending values to the graph as it is now; the objects now without a value
        in the file (``None`` when the file's paths are not ours to compare)."""
        if self._pending:
            self._apply_pending()
        if saved is None:
            return None
        restored = self._status.matched if self._status is not None else set()
        return required_paths(collect_slots(self._named())) - saved - restored

    def _apply_pending(self, named: Optional[Dict[str, Any]] = None) -> None:
        """Values restored earlier for objects that appeared since (anywhere in the graph):
        matched by the reader's rule, checked, then read by this rank alone (attaching
        needs no other rank)."""
        named = self._named() if named is None else named
        reader: CheckpointReader = self._pending
        slots = collect_slots(named, self._assign)
        found = reader.match(slots, named, self._root)
        if in_symbolic_build():   # a layer built in a symbolic run: Keras drops assignments
            slots, found = initial_values_only(slots, found)   # (initial values only)
        check = reader.checker(named, slots, found, _check_compatible)  # (NNX: whole)
        entries = {p: reader.entry(t) for p, t in found.items()}
        for path, target in sorted(found.items()):
            check(slots[path], entries[path], path, reader.source)
        values = {p: reader.read_local(e) for p, e in entries.items()}
        matched = self._apply(slots, values, reader.label, reader.array_types(entries))
        used = {found[p] for p in matched}
        reader.consume(used)
        if self._status is not None:
            self._status.matched |= matched
            self._status.unmatched_values -= used
        reader.hook_unbuilt(self, named)
        self._hook_unbuilt(slots)   # objects attached unbuilt get their values when built


def _agreed_slots(named: Dict[str, Any], engine, path: str):
    """The slots of a save; a value that cannot be saved (``ValueError`` naming each path)
    raises on every rank, even where only one rank's graph holds it."""
    slots = None
    with engine.agreed(f"saving {path}"):
        slots = collect_slots(named, strict=True)
    return slots


class _SaveJob:
    """The write of one checkpoint (in the caller's thread, or the writer thread)."""

    def __init__(self, path, values, kinds, engine, on_commit, on_success, on_failure):
        self.path, self.values, self.kinds = path, values, kinds
        self.engine, self.on_commit = engine, on_commit
        self.on_success, self.on_failure = on_success, on_failure

    def run(self) -> None:
        nbytes = sum(v.nbytes for v in self.values.values())
        with timeline.span("checkpoint save", "checkpoint", nbytes=nbytes,
                           file=os.path.basename(data_file(self.path))):
            self._run()

    def _run(self) -> None:
        try:
            H5Writer(self.path, self.engine, self.kinds).write(self.values)
            # the state file names the new checkpoint before anyone moves on
            with self.engine.agreed(f"saving checkpoint {self.path}",
                                    doing="updating the checkpoint state file"):
                if self.on_commit is not None and self.engine.rank == 0:
                    self.on_commit()
        except BaseException:
            if self.on_failure is not None:
                self.on_failure()
            raise
        if self.on_success is not None:
            self.on_success()
