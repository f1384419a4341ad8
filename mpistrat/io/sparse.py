"""Sparse values as ``tf.io.parse_example`` returns them: ``SparseTensorValue``, and the
index arithmetic of ragged rows laid end to end::

    >>> import numpy as np
    >>> from mpistrat.io.sparse import SparseTensorValue, ragged_positions
    >>> rows, positions = ragged_positions(np.array([2, 0, 1]))
    >>> SparseTensorValue(np.stack([rows, positions], 1), np.array([7, 8, 9]),
    ...                   np.array([3, 2])).indices.tolist()
    [[0, 0], [0, 1], [2, 0]]
"""

from typing import NamedTuple

import numpy as np

__all__ = ["SparseTensorValue", "ragged_positions"]


class SparseTensorValue(NamedTuple):
    """``indices`` (int64 [n, rank]), ``values`` [n] and ``dense_shape`` (int64 [rank])."""

    indices: np.ndarray
    values: np.ndarray
    dense_shape: np.ndarray


def ragged_positions(lengths: np.ndarray):
    """For rows of ``lengths`` values each, laid end to end: each value's row and its
    position within its row (the indices of a sparse value).

        >>> [a.tolist() for a in ragged_positions(np.array([2, 0, 1]))]
        [[0, 0, 2], [0, 1, 0]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    positions = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(lengths) - lengths, lengths)
    return rows, positions
