"""What a checkpoint file must say about each value before anything is read. Pure functions.

A file is checked against itself before a byte of data is allocated: the
dtype is a plain numeric or bool type (raw bits for the others, ``dtypes.py``), the kind is one
we write, the partitions tile ``[0, rows)`` exactly, there is one checksum
per partition, and the bytes claimed lie inside the file. Each function raises
``DataLossError`` naming the file and the object path::

    >>> from mpistrat.checkpoint.validate import check_partitions
    >>> check_partitions([(0, 4), (4, 10)], rows=10, where="f.h5, 'w'")
    [(0, 4), (4, 10)]
    >>> check_partitions([(0, 4), (5, 10)], rows=10, where="f.h5, 'w'")
    Traceback (most recent call last):
    ...
    mpistrat.errors.DataLossError: f.h5, 'w': partition 1 starts at row 5, expected 4 (partitions must tile rows 0:10)
"""

from typing import Sequence, Tuple

import numpy as np

from mpistrat.checkpoint.dtypes import check_plain
from mpistrat.errors import DataLossError

__all__ = ["KINDS", "check_dtype", "check_kind", "check_partitions", "check_checksums",
           "check_extent", "MAX_PARTITIONS"]

KINDS = ("variable", "array", "int", "float", "bool", "state")
MAX_PARTITIONS = 1 << 20


def check_dtype(dtype: np.dtype, where: str, error=DataLossError) -> np.dtype:
    """A plain NumPy bool, integer, float or complex dtype (either byte order), as stored in
    the file, else ``error`` (``DataLossError`` when reading; the writer passes ``TypeError``).
    Other types are stored as raw bits under these rules (``dtypes.py``)."""
    dtype = np.dtype(dtype)
    if not check_plain(dtype) or dtype.hasobject or dtype.itemsize == 0:
        raise error(f"{where}: dtype {dtype.str} is not allowed in a checkpoint "
                    f"(plain numeric and bool types only)")
    return dtype


def check_kind(kind, ndim: int, where: str) -> str:
    """A kind we write; number kinds must be scalars."""
    if kind not in KINDS:
        raise DataLossError(f"{where}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
    if kind in ("int", "float", "bool") and ndim != 0:
        raise DataLossError(f"{where}: a {kind} must be a scalar, found {ndim} dimensions")
    return kind


def check_partitions(partitions: Sequence[Sequence[int]], rows: int,
                     where: str) -> list:
    """Partitions ``[(a, b), ...]`` that tile ``[0, rows)`` exactly, non-empty, in order."""
    parts = [tuple(int(x) for x in p) for p in partitions]
    if not parts or len(parts) > min(MAX_PARTITIONS, max(rows, 1)):
        raise DataLossError(f"{where}: {len(parts)} partitions for {rows} rows")
    expected = 0
    for index, part in enumerate(parts):
        if len(part) != 2:
            raise DataLossError(f"{where}: partition {index} is not a (start, stop) pair")
        a, b = part
        if a != expected:
            raise DataLossError(f"{where}: partition {index} starts at row {a}, expected "
                                f"{expected} (partitions must tile rows 0:{rows})")
        if b <= a and rows:
            raise DataLossError(f"{where}: partition {index} ({a}:{b}) is empty")
        expected = b
    if expected != rows:
        raise DataLossError(f"{where}: partitions end at row {expected}, the value has {rows}")
    return parts


def check_checksums(checksums: Sequence[int], partitions: int, where: str) -> list:
    """One CRC-32 per partition."""
    sums = [int(x) for x in checksums]
    if len(sums) != partitions or any(not 0 <= s <= 0xFFFFFFFF for s in sums):
        raise DataLossError(f"{where}: {len(sums)} checksums for {partitions} partitions "
                            f"(one CRC-32 per partition is required)")
    return sums


def check_extent(offset, nbytes: int, file_size: int, where: str) -> Tuple[int, int]:
    """The ``[offset, offset + nbytes)`` a dataset claims must lie inside its file."""
    if nbytes == 0:
        return 0, 0
    if offset is None or offset < 0 or offset + nbytes > file_size:
        raise DataLossError(f"{where}: claims {nbytes} bytes at offset {offset}, but the file "
                            f"holds {file_size} bytes (truncated or crafted)")
    return int(offset), nbytes
