"""Checkpoint layout math: who writes which rows, who reads which. Pure functions.

A value is cut along its first axis into contiguous partitions, at most one
per rank and none smaller than ``min_partition_bytes`` (a 0-d value is one
row). Owners are spread by the value's index so that many small values do
not all land on rank 0. Readers at any world size take contiguous runs of
whole partitions, so each verifies the checksums of exactly what it read::

    >>> from mpistrat.checkpoint.layout import write_partitions, partition_owner, read_runs
    >>> write_partitions(shape=(10, 4), itemsize=4, world_size=3, min_partition_bytes=16)
    [(0, 4), (4, 7), (7, 10)]
    >>> [partition_owner(value_index=1, part=p, world_size=3) for p in range(3)]
    [1, 2, 0]
    >>> read_runs(num_partitions=3, world_size=2)
    [(0, 2), (2, 3)]
"""

from typing import List, Sequence, Tuple

from mpistrat.partition import even_ranges

__all__ = ["rows_of", "write_partitions", "partition_owner", "read_runs", "MIN_PARTITION_BYTES"]

MIN_PARTITION_BYTES = 1 << 20


def rows_of(shape: Sequence[int]) -> int:
    """Rows along the first axis; a 0-d value counts as one row."""
    return int(shape[0]) if len(shape) else 1


def write_partitions(shape: Sequence[int], itemsize: int, world_size: int,
                     min_partition_bytes: int = MIN_PARTITION_BYTES) -> List[Tuple[int, int]]:
    """Row ranges of the partitions of a value of ``shape``."""
    rows = rows_of(shape)
    row_bytes = itemsize
    for dim in shape[1:]:
        row_bytes *= int(dim)
    total = rows * row_bytes
    parts = max(1, min(world_size, rows, total // max(min_partition_bytes, 1)))
    return even_ranges(rows, parts)


def partition_owner(value_index: int, part: int, world_size: int) -> int:
    """The rank that writes partition ``part`` of the ``value_index``-th value."""
    return (value_index + part) % world_size


def read_runs(num_partitions: int, world_size: int) -> List[Tuple[int, int]]:
    """For each reader rank, the ``[first, stop)`` run of partitions it reads."""
    return even_ranges(num_partitions, world_size)
