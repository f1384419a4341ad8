"""File readers: fixed-length records and ``.npy`` arrays over MPI-IO, HDF5 datasets via h5py.

A reader knows how many rows it holds and reads any row range straight from
its files (``MPI.File.Read_at`` in one block per file touched), so a
distributed dataset can read only the rows a rank keeps. ``bytes_read``
counts what this rank read::

    >>> import numpy as np, tempfile, os
    >>> from mpistrat.data import FixedLengthRecordDataset
    >>> path = os.path.join(tempfile.mkdtemp(), "r.bin")
    >>> np.arange(10, dtype=np.int32).tofile(path)
    >>> ds = FixedLengthRecordDataset([path], record_bytes=4, dtype=np.int32)
    >>> [b.tolist() for b in ds.batch(4)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
"""

import math
import operator
import os
import weakref
from typing import List, Optional, Sequence

import numpy as np

from mpistrat.data import ops
from mpistrat.data.dataset import Dataset
from mpistrat.data.mpiio import ReadHandle, open_for_reading, read_runs, runs_of
from mpistrat.errors import DataLossError, NotFoundError

__all__ = ["RecordFiles", "FixedLengthRecordDataset", "NpyDataset", "HDF5Rows", "HDF5Dataset"]


_NUMERIC_KINDS = set("biufc")


def _integer(value, name: str) -> int:
    """An integer argument (``4``, ``np.int64(4)``), never a silently truncated ``4.5``."""
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _numeric(dtype, what: str) -> np.dtype:
    """A plain numeric or bool dtype (or an ``ml_dtypes`` one: bfloat16, the float8 types),
    else ``ValueError`` (no objects, strings or records)."""
    dtype = np.dtype(dtype)
    if getattr(dtype.type, "__module__", "").startswith("ml_dtypes") and dtype.fields is None:
        return dtype
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"{what}: dtype {dtype} is not supported (plain numeric and bool only)")
    return dtype


def _close_all(handles: dict) -> None:
    for handle in handles.values():
        handle.close()
    handles.clear()


def view_of(path: str) -> tuple:
    """What a rank sees of a file when the dataset is built: size and modification time."""
    try:
        stat = os.stat(path)
    except OSError as err:
        return (path, f"unreadable: {err.strerror}")
    return (path, stat.st_size, stat.st_mtime_ns)


class RecordFiles(Dataset):
    """Rows of fixed size in one or more files; rows are numbered across the files in order."""

    def __init__(self, filenames: Sequence[str], record_bytes: int, header_bytes: int = 0,
                 footer_bytes: int = 0, dtype=None, shape: Optional[Sequence[int]] = None):
        if isinstance(filenames, (str, os.PathLike)):
            filenames = [filenames]
        self.files: List[str] = [os.fspath(f) for f in filenames]
        if not self.files:
            raise ValueError("a record dataset needs at least one file")
        record_bytes, header_bytes, footer_bytes = (
            _integer(record_bytes, "record_bytes"), _integer(header_bytes, "header_bytes"),
            _integer(footer_bytes, "footer_bytes"))
        self.record_bytes, self.header_bytes = record_bytes, header_bytes
        if self.record_bytes <= 0:
            raise ValueError(f"record_bytes must be positive, got {record_bytes}")
        if self.header_bytes < 0 or int(footer_bytes) < 0:
            raise ValueError(f"header_bytes and footer_bytes must not be negative, got "
                             f"{header_bytes} and {footer_bytes}")
        self.dtype = _numeric(dtype if dtype is not None else np.uint8, "records")
        if shape is not None:
            self.shape = tuple(_integer(d, "shape") for d in shape)
        elif dtype is not None and self.record_bytes == self.dtype.itemsize:
            self.shape = ()  # one value per record
        else:
            self.shape = (self.record_bytes // self.dtype.itemsize,)
        if any(int(d) <= 0 for d in self.shape) or \
                self.dtype.itemsize * math.prod(self.shape) != self.record_bytes:
            raise ValueError(f"records of {self.record_bytes} bytes cannot hold {self.dtype} "
                             f"values of shape {self.shape}")
        self._set_rows([self._count(f, footer_bytes) for f in self.files])

    def _set_rows(self, counts: List[int]) -> None:
        """Rows per file; the dataset is a random-access source over all of them."""
        self.counts = list(counts)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.bytes_read = 0
        self.views = [view_of(path) for path in self.files]  # agreed by distributed datasets
        Dataset.__init__(self, node=ops.Source(self.num_rows, self.gather_rows, "a file reader",
                                               row_bytes=self.record_bytes))
        self._node.reader = self

    def _count(self, path: str, footer_bytes: int) -> int:
        if not os.path.isfile(path):
            raise NotFoundError(f"record file {path} does not exist or is not a regular file")
        size = os.path.getsize(path)
        body = size - self.header_bytes - footer_bytes
        if body < 0 or body % self.record_bytes:
            raise ValueError(f"{path}: {size} bytes is not header {self.header_bytes} + k x "
                             f"{self.record_bytes}-byte records + footer {footer_bytes}")
        return body // self.record_bytes

    def _handle(self, file_index: int) -> ReadHandle:
        """The file opened once (MPI-IO, this rank alone) and kept: the kernel's read-ahead
        follows a rank's consecutive reads instead of starting over at every batch."""
        handles = self.__dict__.setdefault("_handles", {})
        handle = handles.get(file_index)
        if handle is None:
            handle = handles[file_index] = open_for_reading(self.files[file_index])
            if len(handles) == 1:  # closed when the reader goes, or at exit before MPI ends
                weakref.finalize(self, _close_all, handles)
        return handle

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    def _decode(self, buffer: np.ndarray, count: int) -> np.ndarray:
        self.bytes_read += buffer.nbytes
        return buffer.view(self.dtype).reshape((count,) + self.shape)

    def read_file_rows(self, file_index: int, first: int, stop: int) -> np.ndarray:
        """Rows ``[first, stop)`` of one file, decoded, in one MPI-IO read."""
        count = max(stop - first, 0)
        buffer = read_runs(self._handle(file_index), self.header_bytes, self.record_bytes,
                           np.array([first]), np.array([count])) if count else \
            np.empty(0, np.uint8)
        return self._decode(buffer, count)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Global rows ``[start, stop)``, across file boundaries."""
        return self.gather_rows(np.arange(start, max(start, stop), dtype=np.int64))

    def gather_rows(self, indices: np.ndarray) -> np.ndarray:
        """The rows at global ``indices`` (any order, repeats allowed), read in sorted,
        coalesced runs: one MPI-IO call per file touched."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_rows):
            raise IndexError(f"rows outside [0, {self.num_rows}) of {self.files[0]}...")
        if indices.size < 2 or (np.diff(indices) > 0).all():   # sorted already: no copy
            wanted, inverse = indices, None
        else:
            wanted, inverse = np.unique(indices, return_inverse=True)
        bounds = np.searchsorted(wanted, self.starts)
        parts = [self._read_file_set(index, wanted[bounds[index]:bounds[index + 1]] -
                                     self.starts[index])
                 for index in range(len(self.files)) if bounds[index] < bounds[index + 1]]
        if not parts:
            out = np.empty((0,) + self.shape, dtype=self.dtype)
        else:
            out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out if inverse is None else out[inverse.reshape(-1)]

    def _read_file_set(self, file_index: int, rows: np.ndarray) -> np.ndarray:
        starts, lengths = runs_of(rows)
        buffer = read_runs(self._handle(file_index), self.header_bytes, self.record_bytes,
                           starts, lengths)
        return self._decode(buffer, rows.size)


def FixedLengthRecordDataset(filenames, record_bytes: int, header_bytes: int = 0,
                             footer_bytes: int = 0, buffer_size=None, compression_type=None,
                             num_parallel_reads=None, dtype=None, shape=None) -> RecordFiles:
    """Records of ``record_bytes`` from files, decoded as ``dtype``/``shape`` (uint8 if none)."""
    if compression_type:
        raise ValueError("compressed record files are not supported")
    return RecordFiles(filenames, record_bytes, header_bytes, footer_bytes, dtype, shape)


def _check_npy(path, shape, dtype, offset: int, size: int) -> None:
    """A ``.npy`` header whose shape has rows, no zero or negative sizes, and fits the file."""
    if dtype.hasobject:
        raise ValueError(f"{path}: object arrays are not supported")
    _numeric(dtype, path)
    if not shape or any(int(d) < 0 for d in shape) or any(int(d) == 0 for d in shape[1:]):
        raise ValueError(f"{path}: shape {shape} is not usable as rows (it needs a first "
                         f"axis and positive sizes)")
    body = dtype.itemsize * math.prod(int(d) for d in shape)  # Python ints: never wraps
    if offset + body != size:
        raise ValueError(f"{path}: the header claims {shape} {dtype} ({body} bytes after "
                         f"{offset} bytes of header), but the file holds {size} bytes")


def NpyDataset(filenames) -> RecordFiles:
    """The rows (first axis) of ``.npy`` files of one dtype and row shape, read without loading."""
    if isinstance(filenames, (str, os.PathLike)):
        filenames = [filenames]
    layouts = []
    for path in filenames:
        try:
            with open(path, "rb") as handle:
                version = np.lib.format.read_magic(handle)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(handle)
                offset = handle.tell()
        except FileNotFoundError:
            raise NotFoundError(f".npy file {path} does not exist") from None
        except (ValueError, OverflowError, TypeError, OSError) as err:
            raise ValueError(f"{path} is not a readable .npy file: {err}") from None
        _check_npy(path, shape, dtype, offset, os.path.getsize(path))
        layouts.append((offset, shape, fortran, dtype))
    offsets = {offset for offset, *_ in layouts}
    rows_shape = {(shape[1:], dtype) for _, shape, _, dtype in layouts}
    if len(offsets) != 1 or len(rows_shape) != 1 or any(l[2] for l in layouts) or \
            any(dtype.hasobject for *_, dtype in layouts):
        raise ValueError(f"NpyDataset needs C-ordered numeric .npy files with one header size, "
                         f"dtype and row shape; got {[(p, l[1], str(l[3])) for p, l in zip(filenames, layouts)]}")
    (row_shape, dtype), = rows_shape
    record = dtype.itemsize * math.prod(row_shape)
    return RecordFiles(filenames, record, offsets.pop(), 0, dtype, row_shape)


class HDF5Rows(RecordFiles):
    """The rows of one HDF5 dataset per file; rows are read through h5py slices."""

    def __init__(self, filenames, dataset: str):
        import h5py
        if isinstance(filenames, (str, os.PathLike)):
            filenames = [filenames]
        self.files = [os.fspath(f) for f in filenames]
        self.name = dataset
        layouts = []
        for path in self.files:
            if not os.path.exists(path):
                raise NotFoundError(f"HDF5 file {path} does not exist")
            with h5py.File(path, "r") as f:
                if dataset not in f or not isinstance(f[dataset], h5py.Dataset):
                    raise NotFoundError(f"{path} has no dataset {dataset!r}")
                dset = f[dataset]
                _numeric(dset.dtype, f"{path}: dataset {dataset!r}")
                dcpl = dset.id.get_create_plist()
                if dcpl.get_external_count() or dset.is_virtual:
                    raise ValueError(f"{path}: dataset {dataset!r} maps other files (external "
                                     f"or virtual storage); pass those files themselves")
                if not dset.shape or any(int(d) == 0 for d in dset.shape[1:]):
                    raise ValueError(f"{path}: dataset {dataset!r} of shape {dset.shape} "
                                     f"has no rows of positive size")
                layouts.append((dset.shape, dset.dtype))
        if len({(shape[1:], dtype) for shape, dtype in layouts}) != 1:
            raise ValueError(f"HDF5Dataset needs one dtype and row shape in every file, got "
                             f"{[(p, l[0], str(l[1])) for p, l in zip(self.files, layouts)]}")
        shape, self.dtype = layouts[0]
        self.shape = tuple(shape[1:])
        self.record_bytes = self.dtype.itemsize * math.prod(self.shape)
        self._set_rows([layout[0][0] for layout in layouts])

    def read_file_rows(self, file_index: int, first: int, stop: int) -> np.ndarray:
        import h5py
        if stop <= first:
            return np.empty((0,) + self.shape, dtype=self.dtype)
        try:
            with h5py.File(self.files[file_index], "r") as f:
                rows = f[self.name][first:stop]
        except (OSError, KeyError) as err:
            raise DataLossError(f"{self.files[file_index]}: rows {first}:{stop} of dataset "
                                f"{self.name!r} could not be read ({err})") from None
        self.bytes_read += rows.nbytes
        return rows

    def _read_file_set(self, file_index: int, rows: np.ndarray) -> np.ndarray:
        """Sorted ``rows`` of one file: one slice for a run, else one selection of them all."""
        import h5py
        if rows.size and rows[-1] - rows[0] + 1 == rows.size:
            return self.read_file_rows(file_index, int(rows[0]), int(rows[-1]) + 1)
        try:
            with h5py.File(self.files[file_index], "r") as f:
                out = f[self.name][rows] if rows.size else \
                    np.empty((0,) + self.shape, dtype=self.dtype)
        except (OSError, KeyError, ValueError) as err:
            raise DataLossError(f"{self.files[file_index]}: {rows.size} rows of dataset "
                                f"{self.name!r} could not be read ({err})") from None
        self.bytes_read += out.nbytes
        return out


def HDF5Dataset(filenames, dataset: str) -> HDF5Rows:
    """The rows of the HDF5 dataset ``dataset`` in one or more files (sharded like records)."""
    return HDF5Rows(filenames, dataset)
