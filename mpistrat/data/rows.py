"""``Rows``: some elements of a dataset, held stacked or as a list.

Sources and vectorised maps give *stacked* rows (a nest of arrays whose first
axis is the row), so reading, decoding and batching cost one NumPy call per
leaf. A map applied row by row gives a *list* of elements (they may differ in
shape); ``stack`` turns either form into a batch::

    >>> import numpy as np
    >>> from mpistrat.data.rows import Rows
    >>> rows = Rows.stacked_as({"x": np.arange(6).reshape(3, 2)}, 3)
    >>> rows.take([2, 0]).stack()["x"].tolist()
    [[4, 5], [0, 1]]
    >>> [int(e["x"][0]) for e in rows.slice(1, 3).elements()]
    [2, 4]
"""

from typing import Any, List, Optional, Sequence

import numpy as np

from mpistrat import nest

__all__ = ["Rows", "stack_elements"]


def _stack(*parts: Any) -> np.ndarray:
    """``np.stack``, but ``bytes`` and ``str`` stay whole in an object array (as tf.string:
    NumPy's fixed-width ``S`` strings would drop trailing NUL bytes)."""
    if isinstance(parts[0], (bytes, str)):
        out = np.empty(len(parts), dtype=object)
        out[:] = parts
        return out
    return np.stack(parts)


def _row(leaf: Any, i: int) -> Any:
    """Row ``i`` of a stacked leaf: a view, or the object itself for a 1-D object array
    (records come out as ``bytes``, as tf.data's strings do through ``as_numpy_iterator``)."""
    if getattr(leaf, "dtype", None) == object and leaf.ndim == 1:
        return leaf[i]
    return leaf[i, ...]


def stack_elements(elements: Sequence[Any]) -> Any:
    """One batch from a list of elements of one structure (``ValueError`` if shapes differ)."""
    try:
        return nest.map_structure(_stack, *elements)
    except ValueError as err:
        shapes = sorted({str(tuple(np.shape(leaf))) for e in elements for leaf in nest.flatten(e)})
        raise ValueError(f"cannot batch elements of different shapes ({', '.join(shapes[:6])}): "
                         f"{err}") from None


class Rows:
    """``count`` elements, ``stacked`` (a nest with a leading row axis) or as ``items``."""

    __slots__ = ("count", "stacked", "items")

    def __init__(self, count: int, stacked: Any = None, items: Optional[List[Any]] = None):
        self.count, self.stacked, self.items = count, stacked, items

    @classmethod
    def stacked_as(cls, stacked: Any, count: int) -> "Rows":
        return cls(count, stacked=stacked)

    @classmethod
    def of_items(cls, items: List[Any]) -> "Rows":
        return cls(len(items), items=list(items))

    @property
    def is_stacked(self) -> bool:
        return self.items is None

    def elements(self) -> List[Any]:
        """One nest per row (views into the stacked arrays: ``leaf[i, ...]``)."""
        if self.items is not None:
            return self.items
        leaves = nest.flatten(self.stacked)
        return [nest.pack_sequence_as(self.stacked, [_row(leaf, i) for leaf in leaves])
                for i in range(self.count)]

    def stack(self) -> Any:
        """The rows as one batch; ``LookupError`` for 0 rows of a list (no layout known)."""
        if self.items is None:
            return self.stacked
        if not self.items:
            raise LookupError("no rows to learn the element layout from")
        return stack_elements(self.items)

    def slice(self, start: int, stop: int) -> "Rows":
        stop = max(min(stop, self.count), start)
        if self.items is not None:
            return Rows.of_items(self.items[start:stop])
        return Rows(stop - start, stacked=nest.map_structure(lambda l: l[start:stop], self.stacked))

    def take(self, positions) -> "Rows":
        positions = np.asarray(positions, dtype=np.int64)
        if self.items is not None:
            return Rows.of_items([self.items[p] for p in positions.tolist()])
        return Rows(len(positions), stacked=nest.map_structure(lambda l: l[positions], self.stacked))

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        parts = [p for p in parts if p.count] or list(parts[:1])
        if len(parts) == 1:
            return parts[0]
        if all(p.items is None for p in parts):
            return Rows(sum(p.count for p in parts), stacked=nest.map_structure(
                lambda *leaves: np.concatenate(leaves), *[p.stacked for p in parts]))
        return Rows.of_items([e for p in parts for e in p.elements()])

    def split(self, counts: Sequence[int]) -> List["Rows"]:
        """Consecutive pieces of ``counts`` rows each."""
        out, start = [], 0
        for count in counts:
            out.append(self.slice(start, start + count))
            start += count
        return out
