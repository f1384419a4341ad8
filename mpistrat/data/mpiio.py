"""Reading scattered records of one file with MPI-IO: sorted, coalesced runs, one call.

``runs_of(rows)`` (pure) turns sorted row numbers into runs of consecutive
rows; ``read_runs`` reads them with a single ``Read_at`` through a file view
of an indexed datatype (one run: a plain ``Read_at``), so a rank reading its
128 scattered rows of a global batch makes one MPI call, not 128. Files are
opened with ROMIO's data sieving off for reads (``romio_ds_read=disable``):
sieving would read the whole span between the first and the last record.

MPICH 4.0's ROMIO cannot decode a datatype built with MPI-4's large-count
constructors, which mpi4py 4 always uses: a file view of one aborts the process
("Out of memory in file adio/common/flatten.c", pmodels/mpich#6121, fixed in 4.1).
There (``file_views_work``, pure) each run is one plain ``Read_at`` instead.

    >>> import numpy as np
    >>> from mpistrat.data.mpiio import runs_of
    >>> starts, lengths = runs_of(np.array([3, 4, 5, 9, 11, 12]))
    >>> starts.tolist(), lengths.tolist()
    ([3, 9, 11], [3, 1, 2])
"""

import re
import threading
from typing import Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.errors import DataLossError, NotFoundError

__all__ = ["runs_of", "open_for_reading", "read_runs", "file_views_work"]


def file_views_work(library_version: str, mpi_version: Tuple[int, int]) -> bool:
    """Whether a file view of an indexed datatype can be set with this MPI.

    False for MPICH before 4.1 speaking MPI 4 (its ROMIO aborts on large-count
    datatypes); ``library_version`` is ``MPI.Get_library_version()``.

        >>> file_views_work("MPICH Version: 4.0.2 MPICH Release date: ...", (4, 0))
        False
        >>> file_views_work("MPICH Version: 4.1.2", (4, 1))
        True
        >>> file_views_work("Open MPI v4.1.4, package: Debian OpenMPI", (3, 1))
        True
    """
    if mpi_version < (4, 0):
        return True            # no large-count constructors: mpi4py builds int-count types
    match = re.match(r"MPICH Version:\s*(\d+)\.(\d+)", library_version)
    return not (match and (int(match.group(1)), int(match.group(2))) < (4, 1))


_FILE_VIEWS: list = []          # the answer for this process's MPI, computed once


def _file_views() -> bool:
    if not _FILE_VIEWS:
        _FILE_VIEWS.append(file_views_work(MPI.Get_library_version(), MPI.Get_version()))
    return _FILE_VIEWS[0]


def runs_of(rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(first rows, lengths)`` of the runs of consecutive values in sorted ``rows``."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return rows, rows
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [rows.size]]))
    return rows[starts], lengths


class ReadHandle:
    """A file opened by this rank alone (``COMM_SELF``); reads serialised by a lock
    (a file view is state of the handle, and prefetch threads read too)."""

    def __init__(self, path: str):
        info = MPI.Info.Create()
        info.Set("romio_ds_read", "disable")
        try:
            self.file = MPI.File.Open(MPI.COMM_SELF, path, MPI.MODE_RDONLY, info)
        except MPI.Exception as err:
            raise NotFoundError(f"record file {path} cannot be opened: "
                                f"{err.Get_error_string()}") from None
        finally:
            info.Free()
        self.path = path
        self.lock = threading.Lock()

    def close(self) -> None:
        if not MPI.Is_finalized():
            self.file.Close()


def open_for_reading(path: str) -> ReadHandle:
    return ReadHandle(path)


RUNS_PER_CALL = 256   # Open MPI's OMPIO slows down per run with longer file views


def read_runs(handle: ReadHandle, base: int, record_bytes: int, starts: np.ndarray,
              lengths: np.ndarray) -> np.ndarray:
    """Bytes of the records in runs ``(starts, lengths)`` (record numbers after ``base``
    bytes of header), in order, as one uint8 array; a short read is a ``DataLossError``.

    One ``Read_at`` per run of up to ``RUNS_PER_CALL`` runs, through a file view of an
    indexed datatype (a single run: a plain ``Read_at``)."""
    total = int(lengths.sum()) * record_bytes
    buffer = np.empty(total, dtype=np.uint8)
    position = 0
    with handle.lock:
        for first in range(0, len(starts), RUNS_PER_CALL):
            some_starts = starts[first:first + RUNS_PER_CALL]
            some_lengths = lengths[first:first + RUNS_PER_CALL]
            size = int(some_lengths.sum()) * record_bytes
            _read_some(handle, base, record_bytes, some_starts, some_lengths,
                       buffer[position:position + size])
            position += size
    return buffer


def _read_some(handle, base, record_bytes, starts, lengths, out) -> None:
    status = MPI.Status()
    offset = base + int(starts[0]) * record_bytes
    if len(starts) == 1:
        handle.file.Read_at(offset, out, status)
    elif not _file_views():
        got, position = 0, 0
        for start, length in zip(starts.tolist(), lengths.tolist()):
            size = length * record_bytes
            handle.file.Read_at(base + start * record_bytes, out[position:position + size], status)
            got += status.Get_count(MPI.BYTE)
            position += size
        _check_count(handle, offset, got, out)
        return
    else:
        record = MPI.BYTE.Create_contiguous(record_bytes).Commit()
        layout = record.Create_indexed(lengths.tolist(), starts.tolist()).Commit()
        try:
            handle.file.Set_view(base, MPI.BYTE, layout)
            handle.file.Read_at(0, out, status)
        finally:
            handle.file.Set_view(0, MPI.BYTE, MPI.BYTE)
            layout.Free()
            record.Free()
    _check_count(handle, offset, status.Get_count(MPI.BYTE), out)


def _check_count(handle, offset, got, out) -> None:
    if got != out.nbytes:  # the file shrank after the dataset was built
        raise DataLossError(f"{handle.path}: short read at offset {offset}: {got} of "
                            f"{out.nbytes} bytes (the file was truncated?)")
