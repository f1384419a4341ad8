"""How a ``map`` function is applied: to one element (tuples unpacked, as tf.data calls
it), to stacked rows (``vectorized=True``), on worker threads, in order::

    >>> import numpy as np
    >>> from mpistrat.data.rows import Rows
    >>> apply(lambda x, y: x + y, (1, 2))
    3
    >>> map_stacked(lambda x: x * 2, Rows.stacked_as(np.arange(6), 6), 2).stack().tolist()
    [0, 2, 4, 6, 8, 10]
"""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from mpistrat import nest
from mpistrat.data.rows import Rows

__all__ = ["apply", "parallel_map", "workers_for", "map_stacked", "as_leaf"]


def apply(fn: Callable, element: Any) -> Any:
    """``fn(element)``, or ``fn(*element)`` for a tuple, as tf.data calls map functions."""
    return fn(*element) if isinstance(element, tuple) else fn(element)


_POOL: Dict[int, ThreadPoolExecutor] = {}


def parallel_map(fn: Callable, items: Sequence[Any], workers: int) -> List[Any]:
    """``[fn(x) for x in items]`` on ``workers`` threads, in order (NumPy releases the GIL)."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    pool = _POOL.get(workers)
    if pool is None:
        pool = _POOL[workers] = ThreadPoolExecutor(workers, thread_name_prefix="mpistrat-map")
    return list(pool.map(fn, items))


def workers_for(num_parallel_calls: Optional[int]) -> int:
    """Threads for ``num_parallel_calls`` (``AUTOTUNE``, i.e. -1: the cores, at most 8)."""
    if num_parallel_calls is None:
        return 1
    if num_parallel_calls < 0:
        return max(1, min(8, os.cpu_count() or 1))
    return max(1, int(num_parallel_calls))


def as_leaf(value: Any) -> Any:
    return value if hasattr(value, "shape") and hasattr(value, "__getitem__") else np.asarray(value)


def map_stacked(fn: Callable, rows: Rows, workers: int, rowwise: bool = True) -> Rows:
    """``fn`` on stacked rows (split into ``workers`` pieces run on threads). ``rowwise``:
    the result must be rows again, one per input row (they are split and joined), else a
    ``ValueError``; ``False`` for a replica's slice of a batch, which stays one value."""
    if rows.count == 0 and not rows.is_stacked:
        return rows
    pieces = [rows] if workers <= 1 or rows.count < 2 * workers else rows.split(
        [len(p) for p in np.array_split(np.arange(rows.count), workers)])

    def one(piece):
        out = nest.map_structure(as_leaf, apply(fn, piece.stack()))
        if rowwise:
            _check_rows(out, piece.count)
        return Rows.stacked_as(out, piece.count)
    parts = parallel_map(one, pieces, workers)
    if rowwise and len(parts) > 1:
        shapes = {tuple(np.shape(leaf)[1:] for leaf in nest.flatten(p.stacked)) for p in parts}
        if len(shapes) > 1:   # (rows padded to each call's longest: they depend on the group)
            raise ValueError(
                f"a map(vectorized=True) before batch must treat each row alone, but its rows "
                f"came back with other shapes for other groups of rows ({sorted(shapes)[:2]}):"
                f" a result padded to the longest row of each call (a FixedLenSequenceFeature)"
                f" depends on the group; parse after batch, or row by row without vectorized")
    return Rows.concat(parts)


def _check_rows(out: Any, count: int) -> None:
    """A vectorised map's result holds one row per input row in every part; a sparse value
    (``parse_example``'s ``VarLenFeature``) or a reduction would be cut apart as garbage."""
    shapes = [np.shape(leaf) for leaf in nest.flatten(out)]
    if _has_sparse(out) or any(s[:1] != (count,) for s in shapes):
        raise ValueError(
            f"a map(vectorized=True) before batch must return one row per input row "
            f"({count} here), but it returned values of shapes {shapes[:6]}; a sparse "
            f"value (parse_example's VarLenFeature) describes the whole batch: parse after "
            f"batch (batch().map(..., vectorized=True)), or row by row without vectorized")


def _has_sparse(value: Any) -> bool:
    if hasattr(value, "dense_shape"):
        return True
    if isinstance(value, dict):
        return any(_has_sparse(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_has_sparse(v) for v in value)


