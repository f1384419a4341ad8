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

import os
import weakref
from typing import List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.data.dataset import Dataset
from mpistrat.errors import DataLossError, NotFoundError

__all__ = ["RecordFiles", "FixedLengthRecordDataset", "NpyDataset", "HDF5Rows", "HDF5Dataset",
           "BatchedRecords"]


_NUMERIC_KINDS = set("biufc")


def _numeric(dtype, what: str) -> np.dtype:
    """A plain numeric or bool dtype, else ``ValueError`` (no objects, strings or records)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(f"{what}: dtype {dtype} is not supported (plain numeric and bool only)")
    return dtype


def _close_all(handles: dict) -> None:
    for handle in handles.values():
        if not MPI.Is_finalized():
            handle.Close()
    handles.clear()


class RecordFiles(Dataset):
    """Rows of fixed size in one or more files; rows are numbered across the files in order."""

    def __init__(self, filenames: Sequence[str], record_bytes: int, header_bytes: int = 0,
                 footer_bytes: int = 0, dtype=None, shape: Optional[Sequence[int]] = None):
        if isinstance(filenames, (str, os.PathLike)):
            filenames = [filenames]
        self.files: List[str] = [os.fspath(f) for f in filenames]
        if not self.files:
            raise ValueError("a record dataset needs at least one file")
        self.record_bytes, self.header_bytes = int(record_bytes), int(header_bytes)
        if self.record_bytes <= 0:
            raise ValueError(f"record_bytes must be positive, got {record_bytes}")
        if self.header_bytes < 0 or int(footer_bytes) < 0:
            raise ValueError(f"header_bytes and footer_bytes must not be negative, got "
                             f"{header_bytes} and {footer_bytes}")
        self.dtype = _numeric(dtype if dtype is not None else np.uint8, "records")
        if shape is not None:
            self.shape = tuple(shape)
        elif dtype is not None and self.record_bytes == self.dtype.itemsize:
            self.shape = ()  # one value per record
        else:
            self.shape = (self.record_bytes // self.dtype.itemsize,)
        if any(int(d) <= 0 for d in self.shape) or \
                self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64)) != self.record_bytes:
            raise ValueError(f"records of {self.record_bytes} bytes cannot hold {self.dtype} "
                             f"values of shape {self.shape}")
        self._set_rows([self._count(f, footer_bytes) for f in self.files])

    def _set_rows(self, counts: List[int]) -> None:
        """Rows per file; makes the dataset iterate all rows, file by file."""
        self.counts = list(counts)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.bytes_read = 0
        Dataset.__init__(self, lambda: (row for block in self._blocks(range(len(self.files)))
                                        for row in block))

    def _count(self, path: str, footer_bytes: int) -> int:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise NotFoundError(f"record file {path} does not exist") from None
        body = size - self.header_bytes - footer_bytes
        if body < 0 or body % self.record_bytes:
            raise ValueError(f"{path}: {size} bytes is not header {self.header_bytes} + k x "
                             f"{self.record_bytes}-byte records + footer {footer_bytes}")
        return body // self.record_bytes

    def _handle(self, file_index: int) -> MPI.File:
        """The file opened once (MPI-IO, this rank alone) and kept: the kernel's read-ahead
        follows a rank's consecutive reads instead of starting over at every batch."""
        handles = self.__dict__.setdefault("_handles", {})
        handle = handles.get(file_index)
        if handle is None:
            try:
                handle = MPI.File.Open(MPI.COMM_SELF, self.files[file_index], MPI.MODE_RDONLY)
            except MPI.Exception as err:
                raise NotFoundError(f"record file {self.files[file_index]} cannot be opened: "
                                    f"{err.Get_error_string()}") from None
            handles[file_index] = handle
            if len(handles) == 1:  # closed when the reader goes, or at exit before MPI ends
                weakref.finalize(self, _close_all, handles)
        return handle

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    def read_file_rows(self, file_index: int, first: int, stop: int) -> np.ndarray:
        """Rows ``[first, stop)`` of one file, decoded, in one MPI-IO read."""
        count = max(stop - first, 0)
        buffer = np.empty(count * self.record_bytes, dtype=np.uint8)
        if count:
            offset = self.header_bytes + first * self.record_bytes
            status = MPI.Status()
            self._handle(file_index).Read_at(offset, buffer, status)
            got = status.Get_count(MPI.BYTE)
            if got != buffer.nbytes:  # the file shrank after the dataset was built
                raise DataLossError(f"{self.files[file_index]}: short read at offset {offset}: "
                                    f"{got} of {buffer.nbytes} bytes (the file was truncated?)")
            self.bytes_read += buffer.nbytes
        return buffer.view(self.dtype).reshape((count,) + self.shape)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Global rows ``[start, stop)``, across file boundaries."""
        parts = []
        for index in range(len(self.files)):
            lo, hi = max(start, self.starts[index]), min(stop, self.starts[index + 1])
            if lo < hi:
                parts.append(self.read_file_rows(index, lo - self.starts[index],
                                                 hi - self.starts[index]))
        if not parts:
            return np.empty((0,) + self.shape, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _blocks(self, file_indices, rows_per_block: int = 1 << 16):
        for index in file_indices:
            for first in range(0, self.counts[index], rows_per_block):
                yield self.read_file_rows(index, first,
                                          min(first + rows_per_block, self.counts[index]))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "BatchedRecords":
        """Batches read in one block each (no per-record Python loop)."""
        return BatchedRecords(self, batch_size, drop_remainder)


class BatchedRecords(Dataset):
    """``reader.batch(B)``: global batches, and row ranges for distributed reading."""

    def __init__(self, source: RecordFiles, batch_size: int, drop_remainder: bool):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.source = source
        super().__init__(self._batches, batch_size, drop_remainder, source.options())

    def batch_bounds(self):
        """``(start, stop)`` global rows of each batch."""
        total, size = self.source.num_rows, self._batch_size
        for start in range(0, total, size):
            stop = min(start + size, total)
            if self._drop_remainder and stop - start < size:
                return
            yield start, stop

    def _batches(self):
        for start, stop in self.batch_bounds():
            yield self.source.read_rows(start, stop)

    def with_options(self, options) -> "BatchedRecords":
        copy = BatchedRecords(self.source, self._batch_size, self._drop_remainder)
        copy._options = options
        return copy


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
    body = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
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
                _check_npy(path, shape, dtype, offset, os.path.getsize(path))
                layouts.append((offset, shape, fortran, dtype))
        except FileNotFoundError:
            raise NotFoundError(f".npy file {path} does not exist") from None
        except ValueError as err:
            raise ValueError(f"{path} is not a readable .npy file: {err}") from None
    offsets = {offset for offset, *_ in layouts}
    rows_shape = {(shape[1:], dtype) for _, shape, _, dtype in layouts}
    if len(offsets) != 1 or len(rows_shape) != 1 or any(l[2] for l in layouts) or \
            any(dtype.hasobject for *_, dtype in layouts):
        raise ValueError(f"NpyDataset needs C-ordered numeric .npy files with one header size, "
                         f"dtype and row shape; got {[(p, l[1], str(l[3])) for p, l in zip(filenames, layouts)]}")
    (row_shape, dtype), = rows_shape
    record = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
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
        self.record_bytes = self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
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


def HDF5Dataset(filenames, dataset: str) -> HDF5Rows:
    """The rows of the HDF5 dataset ``dataset`` in one or more files (sharded like records)."""
    return HDF5Rows(filenames, dataset)
