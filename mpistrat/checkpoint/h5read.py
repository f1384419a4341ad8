"""Reading a checkpoint file: validate it against itself, then read into place.

``read_catalog`` opens the file (every rank), checks every dataset before a
byte of data is allocated (``validate.py``: dtype, kind, partitions that tile
the rows, one checksum per partition, contiguous storage or our own
part-file mapping, bytes that lie inside the file) and agrees on the result:
a file that differs between ranks, or that fails on one, raises on all.
``read_values`` then reads each value straight into one buffer of its final
shape: small values whole on every rank; large ones as contiguous runs of
partitions, one run per node (the ranks of a node share its page cache), checksummed in
worker threads, then completed in place by a broadcast of each run (no second copy).
Nothing is ever unpickled, and HDF5 external storage or foreign virtual
datasets are refused, so a crafted file cannot make us read other files.
"""

import hashlib
import math
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import h5py
import numpy as np
from mpi4py import MPI

from mpistrat.collectives.agreement import agree_view
from mpistrat.checkpoint.dtypes import ARRAY_TYPE_ATTR, DTYPE_ATTR, logical_dtype
from mpistrat.checkpoint.files import part_match
from mpistrat.checkpoint.graph import check_path
from mpistrat.checkpoint.h5base import READ_VERSIONS, checksum
from mpistrat.checkpoint.layout import read_runs, rows_of
from mpistrat.checkpoint.openfile import OpenFile
from mpistrat.checkpoint.tf_origin import entry_names
from mpistrat.checkpoint.validate import (MAX_PARTITIONS, check_checksums, check_dtype,
                                          check_extent, check_kind, check_partitions)
from mpistrat.collectives import CollectiveEngine
from mpistrat.collectives.deadline import wait_all
from mpistrat.collectives.objects import allgather_object, deadline_of
from mpistrat.errors import DataLossError, NotFoundError
from mpistrat.runtime import get_world
from mpistrat.runtime.faults import fault_point

__all__ = ["Entry", "Reader", "read_catalog", "read_values", "read_entry", "SMALL_BYTES"]

SMALL_BYTES = 1 << 20  # values below this are read whole by every rank
_COMPACT_MAX = 64 << 10


@dataclass
class Entry:
    """One validated value of a checkpoint file and where its partitions' bytes lie."""

    path: str
    shape: Tuple[int, ...]
    dtype: np.dtype
    kind: str
    partitions: List[Tuple[int, int]]
    checksums: List[int]
    pieces: List[Tuple[str, Optional[int]]]  # per partition: (file, byte offset); None: inline
    source: str = ""                          # the checkpoint file
    files: Dict[str, OpenFile] = field(default_factory=dict, repr=False)  # path -> open file
    inline: Optional[np.ndarray] = field(default=None, repr=False)  # tiny compact values
    array_type: str = ""                      # "jax": saved from a JAX array
    tf_full_name: str = ""                    # converted from TensorFlow: the value's name
    tf_key: str = ""                          # ... and its key there (``tf_origin.py``)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: never wraps

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def read_catalog(final: str, engine: CollectiveEngine) -> Dict[str, Entry]:
    """The validated contents of ``final``, the same on every rank (collective)."""
    catalog = None
    with engine.agreed(f"restoring {final}"):
        try:
            catalog = _catalog(final)
        except (DataLossError, NotFoundError):
            raise
        except Exception as err:  # noqa: BLE001 - h5py raises OSError/KeyError on damaged files
            raise DataLossError(f"{final} could not be read as an mpistrat checkpoint "
                                f"({type(err).__name__}: {err})") from err
    digest = hashlib.sha1(repr(sorted((p, e.shape, e.dtype.str, e.kind, e.partitions,
                                       e.checksums) for p, e in catalog.items())).encode())
    agree_view(engine, digest.hexdigest()[:16], f"{final} (its contents)", error=DataLossError)
    return catalog


def _catalog(final: str) -> Dict[str, Entry]:
    """Each file is opened once: h5py reads its catalog, and later its data are read,
    through that one descriptor (``openfile.py``)."""
    files = {final: OpenFile(final)}
    parts: Dict[str, h5py.File] = {}
    try:
        with files[final].h5() as f:
            version = _scalar_attr(f, "mpistrat_format_version", final)
            if version not in READ_VERSIONS:
                raise DataLossError(f"{final} is not an mpistrat checkpoint (format version "
                                    f"{version!r}; this version reads {READ_VERSIONS})")
            return {name: _entry(final, files, f[name], name, parts)
                    for name in _dataset_paths(f, final)}
    finally:
        for handle in parts.values():
            handle.close()


def _scalar_attr(obj, name: str, where: str):
    if name not in obj.attrs:
        raise DataLossError(f"{where}: attribute {name} is missing: not an mpistrat checkpoint")
    value = obj.attrs[name]
    return value.item() if isinstance(value, np.generic) else value


def _array_attr(obj, name: str, where: str, ndim: int) -> np.ndarray:
    if name not in obj.attrs:
        raise DataLossError(f"{where}: attribute {name} is missing")
    attr = h5py.h5a.open(obj.id, name.encode())
    if attr.get_space().get_simple_extent_npoints() > 2 * MAX_PARTITIONS or \
            attr.dtype.kind not in "iu":
        raise DataLossError(f"{where}: attribute {name} is not an integer array of sane size")
    value = np.asarray(obj.attrs[name], dtype=np.int64)
    if value.ndim != ndim and value.size:
        raise DataLossError(f"{where}: attribute {name} has {value.ndim} dimensions, "
                            f"expected {ndim}")
    return value.reshape((-1, 2) if ndim == 2 else (-1,))


def _dataset_paths(f: h5py.File, final: str) -> List[str]:
    names: List[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    for name in names:
        if not isinstance(name, str):      # (h5py's way with a name that is not UTF-8)
            raise DataLossError(f"{final}: dataset {bytes(name)[:80]!r}: its name is not UTF-8 "
                                f"text, which is not allowed in a checkpoint")
        try:
            check_path(name)
        except ValueError as err:
            raise DataLossError(f"{final}: dataset {name!r}: {err}") from None
    return sorted(names)


def _entry(final: str, files: Dict[str, OpenFile], dset: h5py.Dataset, name: str,
           parts) -> Entry:
    where = f"{final}, object {name!r}"
    if dset.shape is None:
        raise DataLossError(f"{where}: a dataset without a shape")
    dtype = logical_dtype(check_dtype(dset.dtype, where),
                          dset.attrs[DTYPE_ATTR] if DTYPE_ATTR in dset.attrs else None, where)
    shape = tuple(int(d) for d in dset.shape)
    kind_attr = _scalar_attr(dset, "mpistrat_kind", where)
    kind = check_kind(kind_attr.decode() if isinstance(kind_attr, bytes) else kind_attr,
                      len(shape), where)
    partitions = check_partitions(_array_attr(dset, "mpistrat_partitions", where, 2).tolist(),
                                  rows_of(shape), where)
    sums = check_checksums(_array_attr(dset, "mpistrat_checksums", where, 1).tolist(),
                           len(partitions), where)
    entry = Entry(name, shape, dtype, kind, partitions, sums, [], final, files)
    if ARRAY_TYPE_ATTR in dset.attrs and _scalar_attr(dset, ARRAY_TYPE_ATTR, where) in \
            ("jax", b"jax"):        # (anything else: a later version's type, read as NumPy)
        entry.array_type = "jax"
    entry.tf_full_name, entry.tf_key = entry_names(dset.attrs, where)
    dcpl = dset.id.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.VIRTUAL:
        entry.pieces = _virtual_pieces(final, dset, entry, parts)
        return entry
    _check_plain_storage(dcpl, where)
    if layout == h5py.h5d.COMPACT and entry.nbytes <= _COMPACT_MAX:
        entry.inline = np.asarray(dset[()]).view(dtype).reshape(shape)  # raw bits: same width
        entry.pieces = [(final, None)] * len(partitions)
    elif layout == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset() if entry.nbytes else 0
        check_extent(offset, entry.nbytes, files[final].size, where)
        entry.pieces = [(final, offset + a * entry.row_bytes) for a, _ in partitions]
    else:
        raise DataLossError(f"{where}: chunked or compressed storage is not allowed in a "
                            f"checkpoint (contiguous datasets only)")
    return entry


def _check_plain_storage(dcpl, where: str) -> None:
    if dcpl.get_external_count():
        raise DataLossError(f"{where}: HDF5 external storage is not allowed in a checkpoint "
                            f"(it would read other files)")
    if dcpl.get_nfilters():
        raise DataLossError(f"{where}: filtered (compressed) storage is not allowed")


def _virtual_pieces(final: str, dset, entry: Entry, parts) -> List[Tuple[str, int]]:
    """Our part-file mapping: partition k is dataset ``PATH/part-k`` of a part file beside."""
    where = f"{final}, object {entry.path!r}"
    directory, stem = os.path.dirname(final), os.path.basename(final)[:-3]
    sources: Dict[int, str] = {}
    pattern = re.compile(re.escape(entry.path) + r"/part-(\d+)")
    for source in dset.virtual_sources():
        match = pattern.fullmatch(source.dset_name)
        if os.path.basename(source.file_name) != source.file_name or not match \
                or not part_match(source.file_name, stem):
            raise DataLossError(f"{where}: virtual source {source.file_name}:{source.dset_name} "
                                f"is not one of this checkpoint's part files")
        sources[int(match.group(1))] = source.file_name
    if sorted(sources) != list(range(len(entry.partitions))):
        raise DataLossError(f"{where}: the part files map partitions {sorted(sources)}, "
                            f"expected 0..{len(entry.partitions) - 1}")
    pieces = []
    for k, (a, b) in enumerate(entry.partitions):
        path = os.path.join(directory, sources[k])
        handle = parts.get(path)
        if handle is None:
            if not os.path.isfile(path):
                raise NotFoundError(f"part file {path} of checkpoint {final} is missing")
            entry.files[path] = OpenFile(path)
            handle = parts[path] = entry.files[path].h5()
        name = f"{entry.path}/part-{k}"
        part_where = f"{path}, object {name!r}"
        if name not in handle or not isinstance(handle[name], h5py.Dataset):
            raise DataLossError(f"{part_where}: missing from the part file")
        part = handle[name]
        want = (b - a,) + entry.shape[1:]
        if part.dtype != dset.dtype or tuple(part.shape or ()) != want:
            raise DataLossError(f"{part_where}: holds {part.dtype}{list(part.shape or ())}, "
                                f"the master maps {dset.dtype}{list(want)}")
        dcpl = part.id.get_create_plist()
        _check_plain_storage(dcpl, part_where)
        if dcpl.get_layout() != h5py.h5d.CONTIGUOUS:
            raise DataLossError(f"{part_where}: contiguous storage expected")
        nbytes = (b - a) * entry.row_bytes
        offset = part.id.get_offset() if nbytes else 0
        check_extent(offset, nbytes, entry.files[path].size, part_where)
        pieces.append((path, offset))
    return pieces


# -- data ---------------------------------------------------------------------------------
class Reader:
    """Open files and the checksum threads of one restore; asks the kernel to read ahead.

    Use as a context manager around every ``read_values`` of one restore. The files
    stay open as long as the catalog's entries (``openfile.py``).
    """

    def __init__(self, catalog: Dict[str, Entry], engine: CollectiveEngine):
        self.catalog, self.engine = catalog, engine
        self.pool = ThreadPoolExecutor(max_workers=2)  # zlib releases the GIL
        # Reading is shared among nodes, not ranks: the ranks of a node share its page cache,
        # so each reads its node's run (one read from the file system per node); the first
        # rank of each node then broadcasts that run to the other nodes.
        world = get_world()
        self.node, self.nodes = world.node_index, world.num_nodes
        self.local_rank, self.local_size = world.local_rank, world.local_size
        fault_point("checkpoint-before-reading")
        leaders = allgather_object(engine, self.node if world.local_rank == 0 else None,
                                   "restoring a checkpoint: the node leaders")
        self.roots = [leaders.index(n) for n in range(self.nodes)] if engine.size > 1 else [0]

    def __enter__(self) -> "Reader":
        for path in sorted(self.catalog):  # our byte ranges, read ahead while we work
            entry = self.catalog[path]
            first, stop = self.run(entry)
            for k in range(first, stop):
                file, offset = entry.pieces[k]
                if offset is not None and file:
                    a, b = entry.partitions[k]
                    self._advise(entry.files[file].fd, offset, (b - a) * entry.row_bytes)
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)

    def split(self, entry: Entry) -> bool:
        """Whether the nodes share the reading of ``entry`` (the same answer on every rank)."""
        return entry.nbytes >= SMALL_BYTES and bool(entry.shape) and self.nodes > 1

    def run(self, entry: Entry) -> Tuple[int, int]:
        """The partitions this rank reads: all of a small value (or of any value when all
        ranks share one node), its node's run of a large one."""
        if not self.split(entry):
            return 0, len(entry.partitions)
        return read_runs(len(entry.partitions), self.nodes)[self.node]

    def verifies(self, k: int) -> bool:
        """Whether this rank checks partition ``k``'s checksum: the ranks of a node read the
        same bytes from one page cache, so they share the checking (one check per node)."""
        return k % self.local_size == self.local_rank

    @staticmethod
    def _advise(fd: int, offset: int, nbytes: int) -> None:
        if nbytes and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # advice only

    def read_into(self, path: str, offset: Optional[int], dest: np.ndarray, entry: Entry,
                  k: int) -> None:
        """Fill ``dest`` (partition ``k``'s rows) from its file; a short read is data loss."""
        if offset is None:  # compact storage: tiny, read with the catalog
            a, b = entry.partitions[k]
            data = entry.inline
            dest[...] = data.reshape(1)[a:b] if data.ndim == 0 else data[a:b]
            return
        view = memoryview(dest.reshape(-1).view(np.uint8))
        fd, position = entry.files[path].fd, offset
        while len(view):
            got = os.preadv(fd, [view], position)
            if got <= 0:
                raise DataLossError(f"{path}: short read at offset {position} for object "
                                    f"{entry.path!r}: the file is truncated")
            view, position = view[got:], position + got


def _verify(block: np.ndarray, entry: Entry, k: int, source: str) -> None:
    if checksum(block) != entry.checksums[k]:
        a, b = entry.partitions[k]
        raise DataLossError(f"checksum mismatch in {source}, object {entry.path!r}, rows "
                            f"{a}:{b}: the file is corrupt; restore an earlier checkpoint")


def read_values(final: str, reader: Reader, paths) -> Dict[str, np.ndarray]:
    """Read ``paths`` of the catalog on every rank, checksums verified (collective)."""
    engine, catalog = reader.engine, reader.catalog
    values: Dict[str, np.ndarray] = {}
    large: List[str] = []
    with engine.agreed(f"restoring {final}"):
        try:
            checks: List[Future] = []
            for path in sorted(paths):
                entry = catalog[path]
                dest = np.empty(entry.shape, dtype=entry.dtype)
                rows = dest.reshape((1,) + entry.shape) if not entry.shape else dest
                first, stop = reader.run(entry)
                for k in range(first, stop):
                    a, b = entry.partitions[k]
                    reader.read_into(*entry.pieces[k], rows[a:b], entry, k)
                    if reader.verifies(k):
                        checks.append(reader.pool.submit(_verify, rows[a:b], entry, k,
                                                         entry.pieces[k][0]))
                values[path] = dest
                if reader.split(entry):
                    large.append(path)
            for check in checks:
                check.result()
        except (DataLossError, NotFoundError):
            raise
        except OSError as err:
            raise DataLossError(f"reading {final}: {err}") from err
    for path in large:  # every node read one run of partitions; complete them in place
        _all_gather_rows(values[path], catalog[path], engine, reader)
    return values


class _LocalReader(Reader):
    """A reader for one rank alone (deferred values: every partition, no collective)."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.node, self.nodes, self.local_rank, self.local_size = 0, 1, 0, 1

    def __enter__(self) -> "_LocalReader":
        return self

    def run(self, entry: Entry) -> Tuple[int, int]:
        return 0, len(entry.partitions)


def read_entry(entry: Entry) -> np.ndarray:
    """The whole value of ``entry``, read and verified by this rank alone (not collective)."""
    dest = np.empty(entry.shape, dtype=entry.dtype)
    rows = dest.reshape((1,) + entry.shape) if not entry.shape else dest
    with _LocalReader() as reader:
        for k, (a, b) in enumerate(entry.partitions):
            reader.read_into(*entry.pieces[k], rows[a:b], entry, k)
            _verify(rows[a:b], entry, k, entry.pieces[k][0])
    return dest


def _all_gather_rows(dest: np.ndarray, entry: Entry, engine: CollectiveEngine,
                     reader: Reader) -> None:
    """Complete ``dest`` in place: each node's run of rows goes to every rank.

    One broadcast per node that read something, from its first rank (Open MPI
    4.1's in-place ``Allgatherv`` hung here when some ranks contributed no
    rows); rows travel as a contiguous datatype, so counts stay small.
    """
    flat = dest.reshape(-1).view(np.uint8)
    rowtype = MPI.BYTE.Create_contiguous(entry.row_bytes).Commit()
    try:
        for node, (a, b) in enumerate(read_runs(len(entry.partitions), reader.nodes)):
            if b > a:
                first, stop = entry.partitions[a][0], entry.partitions[b - 1][1]
                block = flat[first * entry.row_bytes:stop * entry.row_bytes]
                engine._guard(wait_all, [engine.comm.Ibcast([block, stop - first, rowtype],
                                                            root=reader.roots[node])],
                              deadline_of(engine), f"restoring {entry.source}: {entry.path!r}")
    finally:
        rowtype.Free()
