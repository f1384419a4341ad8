"""``ms.data.Dataset``: a small counterpart of ``tf.data`` over NumPy.

Elements are nests (dicts, tuples, lists) of NumPy arrays. Datasets are
re-iterable pipelines; each ``iter()`` starts from the beginning::

    >>> from mpistrat.data import Dataset
    >>> [b.tolist() for b in Dataset.range(7).batch(3)]
    [[0, 1, 2], [3, 4, 5], [6]]
    >>> ds = Dataset.from_tensor_slices({"x": [1, 2, 3], "y": [4, 5, 6]}).map(lambda e: e["x"] + e["y"])
    >>> [int(v) for v in ds.filter(lambda v: v > 5)]
    [7, 9]
"""

import itertools
import queue
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data.options import Options

__all__ = ["Dataset", "TensorSpec"]


class TensorSpec(NamedTuple):
    """Shape (``None`` for a dimension that varies) and dtype of one component."""

    shape: tuple
    dtype: np.dtype


class Dataset:
    """A re-iterable pipeline of elements; see the module docstring."""

    def __init__(self, make_iter: Callable[[], Iterator[Any]], batch_size: Optional[int] = None,
                 drop_remainder: bool = False, options: Optional[Options] = None):
        self._make_iter = make_iter
        self._batch_size = batch_size          # set when the elements are batches
        self._drop_remainder = drop_remainder
        self._options = options or Options()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._make_iter())

    def _derive(self, make_iter, batched: bool = True) -> "Dataset":
        return Dataset(make_iter, self._batch_size if batched else None, self._drop_remainder,
                       self._options)

    # -- sources -------------------------------------------------------------
    @staticmethod
    def range(*args, dtype=np.int64) -> "Dataset":
        """Like Python's ``range``: ``range(stop)``, ``range(start, stop[, step])``."""
        bounds = range(*args)
        return Dataset(lambda: (np.asarray(i, dtype=dtype) for i in bounds))

    @staticmethod
    def from_tensor_slices(tensors: Any) -> "Dataset":
        """One element per row of the first axis of every component (rows must agree).

        Dicts and tuples are structure; lists are data, as in tf.data.
        """
        tensors = _lists_to_arrays(tensors)
        arrays = [np.asarray(t) for t in nest.flatten(tensors)]
        rows = {a.shape[0] if a.ndim else None for a in arrays}
        if len(rows) != 1 or None in rows:
            raise ValueError(f"from_tensor_slices: components need the same number of rows, "
                             f"got shapes {[a.shape for a in arrays]}")
        count = rows.pop()
        return Dataset(lambda: (nest.pack_sequence_as(tensors, [a[i] for a in arrays])
                                for i in range(count)))

    @staticmethod
    def zip(datasets: Any) -> "Dataset":
        """Elements of several datasets side by side (stops at the shortest)."""
        parts = nest.flatten(datasets)
        return Dataset(lambda: (nest.pack_sequence_as(datasets, list(items))
                                for items in zip(*parts)))

    # -- transformations -----------------------------------------------------
    def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
        """Stack ``batch_size`` consecutive elements; the last batch may be short."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")

        def batches():
            iterator = iter(self)
            while True:
                chunk = list(itertools.islice(iterator, batch_size))
                if not chunk or (drop_remainder and len(chunk) < batch_size):
                    return
                yield nest.map_structure(lambda *rows: np.stack(rows), *chunk)

        return Dataset(batches, batch_size, drop_remainder, self._options)

    def unbatch(self) -> "Dataset":
        """Split each batch back into its rows."""
        def rows():
            for element in self:
                leaves = nest.flatten(element)
                for i in range(len(leaves[0]) if leaves else 0):
                    yield nest.pack_sequence_as(element, [leaf[i] for leaf in leaves])
        return self._derive(rows, batched=False)

    def map(self, map_func: Callable) -> "Dataset":
        """Apply ``map_func`` to each element (tuples are unpacked into arguments)."""
        return self._derive(lambda: (_apply(map_func, e) for e in self))

    def filter(self, predicate: Callable) -> "Dataset":
        """Keep the elements for which ``predicate`` is true."""
        return self._derive(lambda: (e for e in self if bool(_apply(predicate, e))))

    def shuffle(self, buffer_size: int, seed: Optional[int] = None,
                reshuffle_each_iteration: bool = True) -> "Dataset":
        """Shuffle through a buffer of ``buffer_size`` elements (deterministic for a seed)."""
        epoch = [0]

        def shuffled():
            rng = np.random.default_rng(None if seed is None else
                                        (seed, epoch[0] if reshuffle_each_iteration else 0))
            epoch[0] += 1
            buffer = []
            for element in self:
                buffer.append(element)
                if len(buffer) >= buffer_size:
                    yield buffer.pop(int(rng.integers(len(buffer))))
            while buffer:
                yield buffer.pop(int(rng.integers(len(buffer))))
        return self._derive(shuffled)

    def repeat(self, count: Optional[int] = None) -> "Dataset":
        """Repeat the dataset ``count`` times (forever for ``None``)."""
        def repeated():
            for _ in (itertools.count() if count is None or count < 0 else range(count)):
                yield from self
        return self._derive(repeated)

    def take(self, count: int) -> "Dataset":
        """The first ``count`` elements."""
        return self._derive(lambda: itertools.islice(self, max(count, 0)))

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements."""
        return self._derive(lambda: itertools.islice(self, max(count, 0), None))

    def shard(self, num_shards: int, index: int) -> "Dataset":
        """Every ``num_shards``-th element, starting at ``index``."""
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} is outside [0, {num_shards})")
        return self._derive(lambda: itertools.islice(self, index, None, num_shards))

    def enumerate(self, start: int = 0) -> "Dataset":
        """Pairs ``(index, element)``."""
        return self._derive(lambda: ((np.int64(i), e) for i, e in enumerate(self, start)))

    def prefetch(self, buffer_size: int = 1) -> "Dataset":
        """Produce up to ``buffer_size`` elements ahead in a background thread."""
        return self._derive(lambda: _prefetched(self, max(int(buffer_size), 1)))

    def with_options(self, options: Options) -> "Dataset":
        """The same dataset carrying ``options`` (auto-shard policy and friends)."""
        return Dataset(self._make_iter, self._batch_size, self._drop_remainder, options)

    def options(self) -> Options:
        return self._options

    @property
    def element_spec(self) -> Any:
        """``TensorSpec`` per component, read from the first element (batch dims vary)."""
        first = next(iter(self))
        vary = self._batch_size is not None and not self._drop_remainder
        return nest.map_structure(
            lambda x: TensorSpec(((None,) + np.shape(x)[1:]) if vary and np.ndim(x) else
                                 np.shape(x), np.asarray(x).dtype), first)


def _lists_to_arrays(structure: Any) -> Any:
    if isinstance(structure, dict):
        return type(structure)((k, _lists_to_arrays(v)) for k, v in structure.items())
    if isinstance(structure, tuple):
        items = [_lists_to_arrays(v) for v in structure]
        return type(structure)(*items) if hasattr(structure, "_fields") else tuple(items)
    return np.asarray(structure)


def _apply(fn: Callable, element: Any) -> Any:
    return fn(*element) if isinstance(element, tuple) else fn(element)


_DONE = object()


def _prefetched(dataset: Dataset, depth: int) -> Iterator[Any]:
    buffer: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for element in dataset:
                while not stop.is_set():
                    try:
                        buffer.put(element, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            buffer.put(_DONE)
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            buffer.put(err)

    thread = threading.Thread(target=produce, daemon=True, name="mpistrat-prefetch")
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
