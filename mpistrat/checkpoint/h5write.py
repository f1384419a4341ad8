"""Writing a checkpoint file: HDF5 lays it out, every rank writes its partitions itself.

Each step ends with the ranks agreeing on success (``engine.agreed``), so
a full disk, a read-only directory or a file size limit on one rank ends in the
same named error on every rank, and the previous checkpoint stays intact:

1. Values are checked: each dtype with the reader's own rules (``dtypes.py``:
   raw-bit types get an ``mpistrat_dtype`` attribute, others a ``TypeError``
   naming the path). Each rank computes the CRC-32 of every partition (no I/O
   yet) and the ranks compare one digest of them (``consensus.py``): values
   that differ between ranks are refused, naming them. Rank 0 checks free space, every rank its file
   size limit (``ulimit -f``): a checkpoint that cannot fit fails before a
   byte is written.
2. HDF5 writes only the layout: rank 0 alone (serial h5py, no MPI driver)
   creates ``.NAME.tmp-TOKEN`` with every dataset contiguous and allocated,
   all attributes final, and our marker in the user block. Since no HDF5
   call is ever collective, a failing rank cannot leave the others inside
   HDF5 (the hangs and crashes of parallel HDF5 on a full disk).
3. Every rank writes its partitions at the offsets rank 0 broadcast, with
   positional writes checked byte by byte, then ``fsync``.
4. Rank 0 renames the file into place and syncs the directory.

In ``parts`` mode (``MPISTRAT_CHECKPOINT_MODE=parts``, for file systems where
several writers to one file are unsafe) each rank writes its own part file
the same way and rank 0 writes a master mapping them with virtual datasets;
part names carry the save's token, so replacing a prefix never touches the
parts of the checkpoint being replaced until the new one is complete.
"""

import os
import resource
import threading
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np

from mpistrat.collectives.agreement import agree_view
from mpistrat.checkpoint import h5layout
from mpistrat.checkpoint.consensus import agree_values, value_digest
from mpistrat.checkpoint.h5base import FORMAT_VERSION, checksum
from mpistrat.checkpoint.dtypes import ARRAY_TYPE_ATTR, DTYPE_ATTR, to_stored
from mpistrat.checkpoint.files import (MARKER, USERBLOCK, create_exclusive, part_name,
                                       remove_checkpoint, same_file, temp_name)
from mpistrat.checkpoint.layout import partition_owner, write_partitions
from mpistrat.checkpoint.tf_origin import graph_attrs, value_attrs
from mpistrat.checkpoint.validate import check_dtype
from mpistrat.collectives import CollectiveEngine
from mpistrat.collectives.objects import broadcast_object
from mpistrat.runtime.faults import fault_point
from mpistrat.runtime import settings

__all__ = ["FORMAT_VERSION", "write_file", "checkpoint_mode", "checksum", "fsync_dir"]

_META_BYTES = 1 << 20  # room kept for HDF5's own metadata when checking free space


def checkpoint_mode() -> str:
    """``parallel`` (one shared file, the default) or ``parts`` (``MPISTRAT_CHECKPOINT_MODE``)."""
    return settings.get("MPISTRAT_CHECKPOINT_MODE")


def _parallel_checksums(blocks: List[np.ndarray]) -> List[int]:
    """CRC-32 of each block, on two threads (zlib releases the GIL). Plain threads, not an
    executor: an async save may still run while the interpreter exits, when executors refuse."""
    sums: List[int] = [0] * len(blocks)

    def work(indices):
        for i in indices:
            sums[i] = checksum(blocks[i])

    helper = threading.Thread(target=work, args=(range(1, len(blocks), 2),))
    helper.start()
    work(range(0, len(blocks), 2))
    helper.join()
    return sums


def _rows(value: np.ndarray, a: int, b: int) -> np.ndarray:
    return value.reshape(1) if value.ndim == 0 else value[a:b]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    _fsync(directory or ".")


class _Plan:
    """Who writes what: partitions, owners and this rank's blocks."""

    def __init__(self, values: Dict[str, np.ndarray], rank: int, size: int):
        self.paths = sorted(values)
        self.values = values
        self.layouts = {p: write_partitions(values[p].shape, values[p].dtype.itemsize, size)
                        for p in self.paths}
        self.owned: List[Tuple[str, int]] = [
            (p, k) for i, p in enumerate(self.paths) for k in range(len(self.layouts[p]))
            if partition_owner(i, k, size) == rank]
        self.nbytes = sum(v.nbytes for v in values.values())
        self.dtype_names: Dict[str, str] = {}  # path -> mpistrat_dtype, for raw-bit values

    def block(self, path: str, part: int) -> np.ndarray:
        a, b = self.layouts[path][part]
        return _rows(self.values[path], a, b)


def write_file(final: str, values: Dict[str, np.ndarray], kinds: Dict[str, str],
               engine: CollectiveEngine, mode: Optional[str] = None,
               tf_names: Optional[Dict[str, str]] = None,
               tf_keys: Optional[Dict[str, str]] = None, tf_graph: Optional[bytes] = None) -> None:
    """Write ``values`` (the same on every rank) to ``final``, atomically. Collective.
    ``tf_names``, ``tf_keys``, ``tf_graph`` (``convert``): TensorFlow's ``full_name`` and key
    of values, and the source's object graph, kept as attributes (``tf_origin.py``).

    Refused on every rank before a byte is written: a dtype that could not be restored
    (``TypeError`` naming the object path, ``dtypes.py``) and values that differ between
    ranks (``ValueError`` naming the values and ranks, ``consensus.py``).
    """
    rank, size = engine.rank, engine.size
    mode = mode or checkpoint_mode()
    directory = os.path.dirname(final) or "."
    what = f"saving checkpoint {final}"
    token = broadcast_object(engine, uuid.uuid4().hex if rank == 0 else None, 0,
                             f"{what}: the save token")
    stored = None
    with engine.agreed(what, doing="checking dtypes"):
        stored = _stored(values)
    plan = _Plan({p: v for p, (v, _) in stored.items()}, rank, size)
    plan.dtype_names = {p: name for p, (_, name) in stored.items() if name is not None}
    plan.tf_attrs = {p: value_attrs((tf_names or {}).get(p), (tf_keys or {}).get(p))
                     for p in plan.paths}
    plan.root_attrs = graph_attrs(tf_graph)
    every = [(p, k) for p in plan.paths for k in range(len(plan.layouts[p]))]
    fault_point("checkpoint-before-checksums")
    checksums = dict(zip(every, _parallel_checksums([plan.block(*pk) for pk in every])))
    agree_values(engine, _value_table(plan, kinds, checksums), what)
    with engine.agreed(what, doing="checking space"):
        _preflight(directory, plan, rank)
    if mode == "parts":
        _write_parts(final, plan, kinds, checksums, token, engine, what)
    else:
        _write_shared(final, plan, kinds, checksums, token, engine, what)


def _stored(values: Dict[str, np.ndarray]) -> Dict[str, Tuple[np.ndarray, Optional[str]]]:
    """Each value as it is written, with its ``mpistrat_dtype`` name (``TypeError`` if none)."""
    stored = {}
    for path in sorted(values):
        value, name = to_stored(np.asarray(values[path]), path)
        check_dtype(value.dtype, f"object {path!r}", error=TypeError)  # the reader's own rule
        stored[path] = (value, name)
    return stored


def _value_table(plan: "_Plan", kinds, checksums) -> Dict[str, Tuple[str, str]]:
    """path -> (dtype and shape, digest of everything this rank would save for it)."""
    table = {}
    for p in plan.paths:
        value = plan.values[p]
        dtype = plan.dtype_names.get(p, value.dtype.str)
        crcs = [checksums[(p, k)] for k in range(len(plan.layouts[p]))]
        table[p] = (f"{dtype}{list(value.shape)}",
                    value_digest(dtype, value.shape, kinds[p], crcs))
    return table


def _preflight(directory: str, plan: _Plan, rank: int) -> None:
    """Free space (rank 0) and the file size limit (every rank), before any write: an
    ``OSError`` (``EFBIG``, ``ENOSPC``) when the checkpoint cannot fit.

    HDF5 can crash when its own metadata writes fail, so what it writes must
    fit: the file size limit (exact and local) is always checked, and so is
    room for the layout; the free space for all the data is checked unless
    ``MPISTRAT_CHECKPOINT_PREFLIGHT=0`` (for file systems whose free-space
    figure is no guide, e.g. per-user quotas; a full disk then fails in our
    own checked writes, with the same named error).
    """
    need = plan.nbytes + _META_BYTES
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < need:
        raise OSError(27, f"the file size limit (ulimit -f) is {limit} bytes, the "
                          f"checkpoint needs up to {need}")
    if rank == 0:
        if not settings.get("MPISTRAT_CHECKPOINT_PREFLIGHT"):
            need = _META_BYTES
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if free < need:
            raise OSError(28, f"{directory} has {free} bytes free, the checkpoint needs {need}")


def _attr_spec(value):
    """An attribute for the layout process: ``[data, dtype or None]``."""
    if isinstance(value, np.ndarray):
        return [value.tolist(), value.dtype.str]
    if isinstance(value, (int, np.integer)):
        return [int(value), "<i8"]
    return [value, None]


def _create_layout(path: str, entries, root_attrs: Dict, sources=None) -> Tuple[Dict[str, int], int]:
    """Create ``path`` (``O_EXCL|O_NOFOLLOW``) with its datasets laid out (in the HDF5 layout
    process); return each dataset's byte offset and the open descriptor (the caller closes
    it). ``sources[name]`` makes ``name`` a virtual dataset over part files."""
    datasets = []
    for name, value, attrs in entries:
        item = {"name": name, "shape": list(value.shape), "dtype": value.dtype.str,
                "attrs": {k: _attr_spec(v) for k, v in attrs.items()}}
        if value.ndim == 0:
            item["scalar"] = value.tobytes().hex()
        elif sources and name in sources:
            item["sources"] = sources[name]
        datasets.append(item)
    fd = create_exclusive(path)
    try:
        offsets = h5layout.create({"path": path, "userblock": USERBLOCK, "marker": MARKER.hex(),
                                   "datasets": datasets,
                                   "attrs": {k: _attr_spec(v) for k, v in root_attrs.items()}},
                                  fd)
    except BaseException:
        if same_file(fd, path):  # ours: a failed layout leaves nothing behind
            _discard(path)
        os.close(fd)
        raise
    return offsets, fd


def _write_blocks(path: str, blocks) -> None:
    """Positional writes of ``(offset, block)`` into an existing file, then ``fsync``."""
    # never created here: the file is the one rank 0 laid out (a symlink there is refused)
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for offset, block in blocks:
            view = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
            while len(view):
                written = os.pwrite(fd, view, offset)
                if written <= 0:
                    raise OSError(28, f"short write at offset {offset}")
                view, offset = view[written:], offset + written
            fault_point("checkpoint-partition-written")
        os.fsync(fd)
    finally:
        os.close(fd)


def _attrs(plan: _Plan, kinds, checksums, path: str) -> Dict:
    parts = plan.layouts[path]
    kind, _, array_type = kinds[path].partition(":")   # "array:jax": saved from a JAX array
    attrs = {"mpistrat_kind": kind,
             "mpistrat_partitions": np.array(parts, dtype=np.int64),
             "mpistrat_checksums": np.array([checksums[(path, k)] for k in range(len(parts))],
                                            dtype=np.uint32)}
    if path in plan.dtype_names:
        attrs[DTYPE_ATTR] = plan.dtype_names[path]
    if array_type:
        attrs[ARRAY_TYPE_ATTR] = array_type
    attrs.update(plan.tf_attrs[path])
    return attrs


def _root_attrs(size: int, token: str, extra: Optional[Dict] = None) -> Dict:
    return {"mpistrat_format_version": FORMAT_VERSION, "mpistrat_world_size": size,
            "mpistrat_token": token, **(extra or {})}


def _discard(*paths: str) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def _write_shared(final, plan, kinds, checksums, token, engine, what) -> None:
    rank, size = engine.rank, engine.size
    tmp = temp_name(final, token)
    created = None  # rank 0: the descriptor of the file it created
    try:
        offsets = None
        with engine.agreed(what, doing=f"laying out {tmp}"):
            if rank == 0:
                entries = [(p, plan.values[p], _attrs(plan, kinds, checksums, p))
                           for p in plan.paths]
                offsets, created = _create_layout(tmp, entries,
                                                  _root_attrs(size, token, plan.root_attrs))
        offsets = broadcast_object(engine, offsets, 0, f"{what}: the layout")
        agree_view(engine, "file" if os.path.isfile(tmp) else "nothing", f"{tmp} (written by rank 0)")
        blocks = [(offsets[p] + plan.layouts[p][k][0] * _row_bytes(plan.values[p]), plan.block(p, k))
                  for p, k in plan.owned if p in offsets]
        with engine.agreed(what, doing=f"writing {tmp}"):
            _write_blocks(tmp, blocks)
        with engine.agreed(what, doing=f"committing {final}"):
            if rank == 0:
                _commit(tmp, final, created)
    except BaseException:
        if created is not None and same_file(created, tmp):
            _discard(tmp)
        raise
    finally:
        if created is not None:
            os.close(created)


def _row_bytes(value: np.ndarray) -> int:
    return value.dtype.itemsize * int(np.prod(value.shape[1:], dtype=np.int64))


def _commit(tmp: str, final: str, fd: int) -> None:
    """Rename ``tmp`` (open as ``fd``, created by us) over ``final``, durably."""
    fault_point("checkpoint-before-commit")
    os.fsync(fd)
    if not same_file(fd, tmp):
        raise OSError(17, f"{tmp} is no longer the file this save created (replaced meanwhile)")
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))


def _write_parts(final, plan, kinds, checksums, token, engine, what) -> None:
    rank, size = engine.rank, engine.size
    parts = [part_name(final, r, size, token) for r in range(size)]
    mine, tmp = parts[rank], temp_name(parts[rank], token)
    master_tmp = temp_name(final, token)

    def write_part():
        entries = [(f"{p}/part-{k}", plan.block(p, k), {}) for p, k in plan.owned]
        offsets, fd = _create_layout(tmp, entries, _root_attrs(size, token))
        try:
            _write_blocks(tmp, [(offsets[name], block) for name, block, _ in entries
                                if name in offsets])
            _commit(tmp, mine, fd)
        finally:
            os.close(fd)

    try:
        with engine.agreed(what, doing=f"writing {tmp}"):
            write_part()
        with engine.agreed(what, doing=f"writing the master {master_tmp}"):
            if rank == 0:
                _write_master(master_tmp, final, plan, kinds, checksums, parts, token, size)
    except BaseException:
        _discard(tmp, mine, *([master_tmp] if rank == 0 else []))
        raise
    if rank == 0:  # the parts of the checkpoint this one replaced (same prefix, older token)
        remove_checkpoint(final, keep_token=token)


def _write_master(tmp, final, plan, kinds, checksums, parts, token, size) -> None:
    names = [os.path.basename(p) for p in parts]
    entries, sources = [], {}
    for index, p in enumerate(plan.paths):
        value = plan.values[p]
        entries.append((p, value, _attrs(plan, kinds, checksums, p)))
        if value.ndim:  # a scalar is stored in the master itself
            sources[p] = [[a, b, names[partition_owner(index, part, size)], f"{p}/part-{part}"]
                          for part, (a, b) in enumerate(plan.layouts[p])]
    _, fd = _create_layout(tmp, entries, _root_attrs(size, token, plan.root_attrs), sources)
    try:
        _commit(tmp, final, fd)
    finally:
        os.close(fd)
