"""TensorFlow checkpoints: ``ms.train.load_checkpoint``, ``list_variables``, and restores.

``load_checkpoint(dir_or_prefix)`` (this process alone, as TensorFlow's) reads a bundle
(``tfformats.bundle``): a directory means its latest checkpoint, named by the
``checkpoint`` state file::

    >>> import numpy as np, tempfile, os, mpistrat as ms
    >>> from mpistrat.tfformats import bundle, bundle_writer
    >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
    >>> shard = bundle_writer.write_shard(bundle.data_name(prefix, 0, 1),
    ...                                   [("w/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2, np.float16))])
    >>> bundle_writer.write_index(prefix, 1, shard)
    >>> reader = ms.train.load_checkpoint(prefix)
    >>> reader.get_variable_to_shape_map()
    {'w/.ATTRIBUTES/VARIABLE_VALUE': [2]}
    >>> reader.get_tensor("w/.ATTRIBUTES/VARIABLE_VALUE").dtype
    dtype('float16')

``Checkpoint.restore(tf_prefix)`` reads through ``tf_format.TFReader`` over
:func:`open_values` and :func:`read_collective` (collective): every rank validates the
index and the ranks agree on it; our objects are matched to TensorFlow's
as TensorFlow matches them, through its object graph (``tf_structure``: child names from
the root, bound to what our objects hold under those names, so ``model/dense/kernel``
restores ``model.dense.kernel`` and a Keras model rebuilt on JAX gets its values by Keras's
own attributes, whatever its automatic layer names), then by our object paths for what the
graph does not reach (numbers, a file written from our paths); then each value is read
by one rank only (values dealt to ranks by size; MPI-IO reads of exactly its bytes),
broadcast, and checked (CRC-32C) by every rank, so a corrupt value raises the same
``DataLossError`` everywhere. Values for objects attached later are read when they are.
"""

import hashlib
import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint.files import state_name
from mpistrat.checkpoint.graph import leaf_slot
from mpistrat.checkpoint.tf_structure import bind, structural_matches
from mpistrat.checkpoint.state_file import read_state
from mpistrat.collectives.agreement import agree_view
from mpistrat.collectives.deadline import wait_all
from mpistrat.collectives.objects import deadline_of
from mpistrat.errors import DataLossError, NotFoundError
from mpistrat.tfformats.bundle import (STRING, BundleEntry, BundleIndex, decode_value,
                                       index_name, is_bundle, read_index, read_value)
from mpistrat.tfformats.object_graph import (GRAPH_KEY, MAX_GRAPH_BYTES, ObjectGraph,
                                             attribute_keys, parse_graph)

__all__ = ["load_checkpoint", "list_variables", "CheckpointReader", "resolve_prefix", "latest_in",
           "open_values", "read_collective", "assign_readers", "TensorFlowValues"]

_BATCH_BYTES = 64 << 20
_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
_CHUNK = 1 << 30


def latest_in(directory: str) -> str:
    """The path of the latest checkpoint the state file of ``directory`` names (confined
    to the directory), else ``NotFoundError``; either format."""
    state = read_state(directory)
    name = state_name(directory, state.model_checkpoint_path) if state else None
    if name is None:
        raise NotFoundError(f"no checkpoint in directory {directory}: its 'checkpoint' state "
                            f"file is missing or names no checkpoint inside it")
    return os.path.join(directory, name)


def resolve_prefix(ckpt_dir_or_file: str) -> str:
    """The bundle prefix named by a directory (its state file's latest) or a prefix."""
    path = os.fspath(ckpt_dir_or_file)
    if path.endswith(".index") and is_bundle(path[:-6]):
        return path[:-6]
    if os.path.isdir(path):
        path = latest_in(path)
    if not is_bundle(path):
        ours = os.path.isfile(path if path.endswith(".h5") else path + ".h5")
        raise NotFoundError(f"no TensorFlow checkpoint at {path} (looked for {index_name(path)})"
                            + ("; that is one of ours: restore it with ms.Checkpoint, or "
                               "convert it with python -m mpistrat convert" if ours else ""))
    return path


class CheckpointReader:
    """The tensors of one TensorFlow checkpoint, as ``tf.train.load_checkpoint`` returns."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._index = read_index(prefix)

    def has_tensor(self, name: str) -> bool:
        return name in self._index.entries

    def get_tensor(self, name: str) -> np.ndarray:
        """The value at key ``name`` (read and CRC-checked now)."""
        entry = self._index.entries.get(name)
        if entry is None:
            raise NotFoundError(f"Key {name} not found in checkpoint {self.prefix}")
        value = read_value(entry)
        return value[()] if entry.enum == STRING and value.shape == () else value

    def get_variable_to_shape_map(self) -> Dict[str, List[int]]:
        return {k: list(e.shape) for k, e in sorted(self._index.entries.items())}

    def get_variable_to_dtype_map(self) -> Dict[str, Any]:
        """Key -> NumPy dtype (``object`` for strings, ``ml_dtypes.bfloat16``, ...); for a
        TensorFlow dtype we cannot hold, its name (``"variant"``: ``get_tensor`` refuses it)."""
        return {k: e.refused or e.dtype for k, e in sorted(self._index.entries.items())}


def load_checkpoint(ckpt_dir_or_file: str) -> CheckpointReader:
    """A reader of the TensorFlow checkpoint at a prefix, or a directory's latest."""
    return CheckpointReader(resolve_prefix(ckpt_dir_or_file))


def list_variables(ckpt_dir_or_file: str) -> List[Tuple[str, List[int]]]:
    """``(key, shape)`` of every tensor of the checkpoint, sorted by key."""
    return sorted(load_checkpoint(ckpt_dir_or_file).get_variable_to_shape_map().items())


# -- reading on every rank ----------------------------------------------------------------
def assign_readers(sizes: Sequence[int], ranks: int) -> List[int]:
    """The rank that reads each value: largest first, each to the least loaded rank
    (lowest rank on ties), so every rank reads about 1/ranks of the bytes."""
    loads = [0] * ranks
    readers = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        readers[index] = rank
        loads[rank] += sizes[index]
    return readers


def _batches(entries: Dict[str, BundleEntry]) -> List[List[str]]:
    batches: List[List[str]] = [[]]
    size = 0
    for path in sorted(entries):
        if batches[-1] and size + entries[path].size > _BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(path)
        size += entries[path].size
    return [b for b in batches if b]


read_counts = {"bytes": 0}   # value bytes this process read from bundle files (MPI-IO)


def read_collective(entries: Dict[str, BundleEntry], engine):
    """Every value of ``entries`` (path -> entry) on every rank, each read once (collective);
    yields them in dicts of about 64 MiB.

    For each batch the values are dealt to ranks by size, each rank reads its own with
    MPI-IO, read failures are agreed, each value is broadcast from its reader, and every rank
    decodes and checks it (so a CRC mismatch raises on every rank alike).
    """
    handles: Dict[str, MPI.File] = {}
    try:
        for batch in _batches(entries):
            readers = assign_readers([entries[p].size for p in batch], engine.size)
            raws = {p: np.empty(entries[p].size, dtype=np.uint8) for p in batch}
            with engine.agreed("restoring a TensorFlow checkpoint",
                               doing="reading a TensorFlow checkpoint"):
                for path, reader in zip(batch, readers):
                    if reader == engine.rank:
                        _read_at(entries[path], raws[path], handles)
                        read_counts["bytes"] += raws[path].nbytes
            values = {}
            for path, reader in zip(batch, readers):
                raw = raws.pop(path)
                for lo in range(0, raw.size, _CHUNK):  # timed: a stalled rank is named
                    engine._guard(wait_all, [engine.comm.Ibcast(raw[lo:lo + _CHUNK], root=reader)],
                                  deadline_of(engine), f"restoring a TensorFlow checkpoint: {path}")
                values[path] = decode_value(entries[path], raw)
            yield values
    finally:
        for handle in handles.values():
            handle.Close()


def _read_at(entry: BundleEntry, raw: np.ndarray, handles: Dict[str, MPI.File]) -> None:
    if entry.slices:   # a partitioned tensor: its slices' bytes one after another
        position = 0
        for _, part in entry.slices:
            _read_at(part, raw[position:position + part.size], handles)
            position += part.size
        return
    handle = handles.get(entry.file)
    if handle is None:
        try:
            handle = handles[entry.file] = MPI.File.Open(MPI.COMM_SELF, entry.file,
                                                         MPI.MODE_RDONLY)
        except MPI.Exception as err:
            raise NotFoundError(f"{entry.file} cannot be opened: "
                                f"{err.Get_error_string()}") from None
    for lo in range(0, raw.size, _CHUNK):
        part = raw[lo:lo + _CHUNK]
        status = MPI.Status()
        handle.Read_at(entry.offset + lo, part, status)
        if status.Get_count(MPI.BYTE) != part.size:
            raise DataLossError(f"{entry.file}: short read at offset {entry.offset + lo} for "
                                f"key {entry.key!r} (the data shard is truncated)")


# -- matching our objects to the graph ----------------------------------------------------
class TensorFlowValues:
    """A TensorFlow checkpoint's values by our object paths, matched through its graph."""

    def __init__(self, index: BundleIndex, graph: Optional[ObjectGraph]):
        self.index, self.graph = index, graph
        self.source = index.prefix
        if graph is None:  # no object graph (TF1, or written by hand): keys are the paths
            self.by_path = {k[:-len(_VALUE)] if k.endswith(_VALUE) else k: k
                            for k in index.entries}
            self.collisions: Dict[str, List[str]] = {}
        else:  # values the graph names but the index lacks (TensorFlow's sharded writes
            # leave out empty tensors) are not in the checkpoint
            self.by_path, self.collisions = _paths_of(graph, index)
        self.unmatched = set(self.by_path)

    def match(self, slots, named: Optional[Dict[str, Any]] = None, root: Any = None
              ) -> Dict[str, str]:
        """Our slot path -> the checkpoint path it restores from. First TensorFlow's own rule
        (``tf_structure``: our objects bound to the graph by attribute structure from
        ``named``, the checkpoint's children, and ``root``); then, for what that did not
        reach (numbers, a graph written from our paths, a file without a graph), the value
        at our object's path, unless the structure gave it to another object. Variables
        bound outside our walk get slots, added to ``slots``."""
        found: Dict[str, str] = {}
        if self.graph is not None and named is not None:
            bound = bind(self.graph, named, root)
            found, extra, notes = structural_matches(self.graph, bound, slots,
                                                     set(self.by_path), leaf_slot)
            slots.update(extra)
            if notes:
                warnings.warn(f"restoring {self.source}: the structure is ambiguous: "
                              + "; ".join(notes[:5]), RuntimeWarning, stacklevel=4)
        claimed = set(found.values())
        for path in slots:
            if path in found:
                continue
            if self.graph is None:
                target = path if path in self.by_path else None
            else:
                value = self.graph.find(path)
                target = value.path if value is not None and value.path in self.by_path \
                    else path if path in self.by_path else None   # (_paths_of's suffixes)
            if target is not None and target not in claimed:
                found[path] = target
        return found

    def entry(self, checkpoint_path: str) -> BundleEntry:
        return self.index.entries[self.by_path[checkpoint_path]]


def graph_entry(index: BundleIndex) -> Optional[BundleEntry]:
    """The entry of the object graph (a string scalar), or ``None`` without one."""
    entry = index.entries.get(GRAPH_KEY)
    if entry is not None and (entry.enum != STRING or entry.shape != ()):
        raise DataLossError(f"{index_name(index.prefix)}: {GRAPH_KEY} is not a string scalar")
    if entry is not None and entry.size > MAX_GRAPH_BYTES + 16:   # (its length and checksum)
        raise DataLossError(f"{index_name(index.prefix)}: an object graph of {entry.size} "
                            f"bytes (at most {MAX_GRAPH_BYTES}), refused before it is read")
    return entry


def read_graph(index: BundleIndex) -> Optional[ObjectGraph]:
    """The object graph of ``index``, read by this process alone."""
    entry = graph_entry(index)
    return None if entry is None else parse_graph(read_value(entry)[()],
                                                  f"{entry.file}, key {GRAPH_KEY!r}")


def _paths_of(graph: ObjectGraph, index: BundleIndex):
    """Our path of each index key the graph names, and the paths that several keys become
    (a local name holding '/' spells another object's path: ``{path: [keys]}``). An
    attribute whose saveable wrote several tensors names their common prefix (a tf.data
    iterator's ``.ATTRIBUTES/ITERATOR`` is stored as ``.ATTRIBUTES/ITERATOR_STATE``; a
    lookup table's as ``...-keys`` and ``...-values``): each such key gets the attribute's
    path with the key's suffix."""
    keys_of: Dict[str, List[str]] = {}
    for value, keys in zip(graph.values, attribute_keys(graph, index.entries,
                                                         index_name(index.prefix))):
        for path, key in ((value.path + key[len(value.key):], key) for key in keys):
            if key not in keys_of.setdefault(path, []):
                keys_of[path].append(key)
    paths = {path: found[-1] for path, found in keys_of.items()}   # (the last, as before)
    return paths, {p: sorted(k) for p, k in keys_of.items() if len(k) > 1}


def _digest(index: BundleIndex) -> str:
    text = repr(sorted((k, e.enum, e.shape, e.offset, e.size, e.crc)
                       for k, e in index.entries.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def open_values(prefix: str, engine) -> TensorFlowValues:
    """The validated index and graph of ``prefix``, the same on every rank (collective)."""
    index, entry = None, None
    with engine.agreed(f"reading {prefix}"):
        index = read_index(prefix)
        entry = graph_entry(index)
    agree_view(engine, _digest(index), f"{index_name(prefix)} (its contents)",
               error=DataLossError)
    graph = None
    if entry is not None:  # read by one rank, checked and parsed by all (the same bytes)
        data = next(read_collective({GRAPH_KEY: entry}, engine))[GRAPH_KEY][()]
        graph = parse_graph(data, f"{entry.file}, key {GRAPH_KEY!r}")
    return TensorFlowValues(index, graph)
