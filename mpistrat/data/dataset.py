"""``ms.data.Dataset``: a small counterpart of ``tf.data`` over NumPy.

Elements are nests (dicts, tuples, lists) of NumPy arrays. Datasets are
re-iterable pipelines; each ``iter()`` starts from the beginning (and is a new
epoch for the shuffles, as in TensorFlow)::

    >>> from mpistrat.data import Dataset
    >>> [b.tolist() for b in Dataset.range(7).batch(3)]
    [[0, 1, 2], [3, 4, 5], [6]]
    >>> ds = Dataset.from_tensor_slices({"x": [1, 2, 3], "y": [4, 5, 6]}).map(lambda e: e["x"] + e["y"])
    >>> [int(v) for v in ds.filter(lambda v: v > 5)]
    [7, 9]
    >>> sorted(int(v) for v in Dataset.range(5).global_shuffle(seed=0))
    [0, 1, 2, 3, 4]

*Random access.* Sources (``range``, ``from_tensor_slices``, the file
readers) and ``map``, ``zip``, ``batch``, ``take``, ``skip``, ``shard``,
``repeat``, ``enumerate``, ``prefetch``, ``shuffle`` and ``global_shuffle``
over them can compute any element from its index. Distributed, such a
pipeline reads and maps only the rows a rank keeps, and a restored iterator
seeks to its step. ``filter``, ``unbatch`` and ``Dataset(generator)`` do not;
pipelines through them are iterated element by element (and a restored
iterator replays).
"""

from typing import Any, Callable, Iterator, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data import ops, shuffles
from mpistrat.data.cache import Cache
from mpistrat.data.options import Options
from mpistrat.data.mapping import workers_for
from mpistrat.data.specs import TensorSpec

__all__ = ["Dataset", "TensorSpec", "AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY"]

AUTOTUNE = -1                        # tf.data.AUTOTUNE
INFINITE_CARDINALITY = ops.INFINITE  # tf.data.INFINITE_CARDINALITY
UNKNOWN_CARDINALITY = ops.UNKNOWN


class Dataset:
    """A re-iterable pipeline of elements; see the module docstring.

    ``Dataset(make_iter, batch_size=None, drop_remainder=False)`` wraps a
    function returning a fresh iterator (no random access).
    """

    def __init__(self, make_iter: Optional[Callable[[], Iterator[Any]]] = None,
                 batch_size: Optional[int] = None, drop_remainder: bool = False,
                 options: Optional[Options] = None, *, node: Optional[ops.Node] = None):
        self._node = node if node is not None else ops.Generator(make_iter, batch_size,
                                                                 drop_remainder)
        self._options = options or Options()
        self._epochs = 0   # iterations started: the epoch of the next one

    def __iter__(self) -> Iterator[Any]:
        epoch, self._epochs = self._epochs, self._epochs + 1
        return iter(self._node.elements(ops.Iteration((epoch,))))

    @property
    def _batch_size(self) -> Optional[int]:
        return self._node.batch_size

    @property
    def _drop_remainder(self) -> bool:
        return self._node.drop_remainder

    def _wrap(self, node: ops.Node) -> "Dataset":
        return Dataset(node=node, options=self._options)

    # -- sources -------------------------------------------------------------
    @staticmethod
    def range(*args, dtype=np.int64) -> "Dataset":
        """Like Python's ``range``: ``range(stop)``, ``range(start, stop[, step])``."""
        bounds = range(*args)
        start, step, dtype = bounds.start, bounds.step, np.dtype(dtype)
        return Dataset(node=ops.Source(len(bounds), lambda idx: (start + idx * step).astype(dtype),
                                       "range"))

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
        return Dataset(node=ops.Source(rows.pop(), lambda idx: nest.pack_sequence_as(
            tensors, [a[idx] for a in arrays]), "from_tensor_slices"))

    @staticmethod
    def from_tensors(tensors: Any) -> "Dataset":
        """One element: ``tensors`` whole (Python floats become float32, as in tf.data)::

            >>> [x.tolist() for x in Dataset.from_tensors([1.5, 2.5])]
            [[1.5, 2.5]]
        """
        whole = nest.map_structure(lambda a: a[np.newaxis], _lists_to_arrays(tensors))
        return Dataset.from_tensor_slices(whole)

    @staticmethod
    def from_generator(generator: Callable, output_types: Any = None,
                       output_shapes: Any = None, args: Any = None,
                       output_signature: Any = None) -> "Dataset":
        """The elements that ``generator(*args)`` yields, a new call each iteration, each
        converted to ``output_signature`` (a structure of ``TensorSpec``; or the older
        ``output_types``/``output_shapes``). An element of another structure or shape
        raises ``InvalidArgumentError`` naming it, as tf.data does::

            >>> spec = TensorSpec(shape=(None,), dtype=np.float32)
            >>> ds = Dataset.from_generator(lambda: iter([[1, 2], [3]]), output_signature=spec)
            >>> [x.tolist() for x in ds], ds.element_spec.dtype
            ([[1.0, 2.0], [3.0]], dtype('float32'))
        """
        from mpistrat.data.generators import conformed, signature_of
        signature = signature_of(output_signature, output_types, output_shapes)
        call_args = tuple(args) if args is not None else ()
        if not callable(generator):
            raise TypeError(f"from_generator needs a callable that returns an iterator, "
                            f"got {type(generator).__name__}")

        def elements():
            for index, element in enumerate(generator(*call_args)):
                yield conformed(element, signature, index)

        return Dataset(elements)

    @staticmethod
    def zip(datasets: Any) -> "Dataset":
        """Elements of several datasets side by side (stops at the shortest)."""
        parts = nest.flatten(datasets)
        return Dataset(node=ops.Zip(datasets, [d._node for d in parts]))

    # -- transformations -----------------------------------------------------
    def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
        """Stack ``batch_size`` consecutive elements; the last batch may be short."""
        return self._wrap(ops.Batch(self._node, batch_size, drop_remainder))

    def unbatch(self) -> "Dataset":
        """Split each batch back into its rows."""
        return self._wrap(ops.Unbatch(self._node))

    def map(self, map_func: Callable, num_parallel_calls: Optional[int] = None,
            deterministic: Optional[bool] = None, vectorized: bool = False) -> "Dataset":
        """Apply ``map_func`` to each element (tuples are unpacked into arguments).

        ``num_parallel_calls`` (a count or ``AUTOTUNE``) runs it on that many
        threads; the order stays deterministic. ``vectorized=True`` (ours) says
        that ``map_func`` takes *stacked* rows and treats each row on its own:
        before ``batch`` it is called once per group of rows instead of once
        per row; after ``batch`` (TensorFlow's ``batch().map()`` order) it lets
        a rank map only its own rows of each global batch.
        """
        return self._wrap(ops.Map(self._node, map_func, bool(vectorized),
                                  workers_for(num_parallel_calls)))

    def filter(self, predicate: Callable) -> "Dataset":
        """Keep the elements for which ``predicate`` is true."""
        return self._wrap(ops.Filter(self._node, predicate))

    def shuffle(self, buffer_size: int, seed: Optional[int] = None,
                reshuffle_each_iteration: bool = True) -> "Dataset":
        """Shuffle through a buffer of ``buffer_size`` elements (TensorFlow's rule).

        Deterministic for a seed; without one, the ranks of a distributed dataset
        agree on one. A new order each iteration unless ``reshuffle_each_iteration=False``.
        """
        return self._wrap(shuffles.Shuffle(self._node, buffer_size, seed, reshuffle_each_iteration))

    def global_shuffle(self, seed: Optional[int] = None,
                       reshuffle_each_iteration: bool = True) -> "Dataset":
        """A uniform shuffle of the whole dataset, needing random access (TensorFlow 2.17's).

        Element ``p`` is the input's element ``perm(p)`` for a keyed permutation of the
        indices, computed on demand: nothing is materialised, every rank computes the
        same order, whatever the number of ranks, and any position is found at once.
        """
        reason = self._node.blocker()
        if reason:
            raise ValueError(f"global_shuffle needs random access to its input, but the "
                             f"pipeline has {reason}; move global_shuffle before it, or use "
                             f"shuffle(buffer_size)")
        if self._node.cardinality() < 0:
            raise ValueError("global_shuffle needs a finite dataset (repeat after it, not "
                             "before)")
        return self._wrap(shuffles.GlobalShuffle(self._node, seed, reshuffle_each_iteration))

    def repeat(self, count: Optional[int] = None) -> "Dataset":
        """Repeat the dataset ``count`` times (forever for ``None``)."""
        return self._wrap(ops.Repeat(self._node, count))

    def take(self, count: int) -> "Dataset":
        """The first ``count`` elements (all for a negative count, as in tf.data)."""
        count = int(count)
        return self._wrap(ops.IndexSlice(self._node, 0, None if count < 0 else count, 1, "take"))

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements."""
        return self._wrap(ops.IndexSlice(self._node, max(int(count), 0), None, 1, "skip"))

    def shard(self, num_shards: int, index: int) -> "Dataset":
        """Every ``num_shards``-th element, starting at ``index``."""
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} is outside [0, {num_shards})")
        return self._wrap(ops.IndexSlice(self._node, int(index), None, int(num_shards), "shard"))

    def enumerate(self, start: int = 0) -> "Dataset":
        """Pairs ``(index, element)``."""
        return self._wrap(ops.Enumerate(self._node, start))

    def cache(self, filename: str = "") -> "Dataset":
        """Keep the elements of the first iteration in memory; every later iteration
        yields them again (a ``map`` below runs once per element, a shuffle below is
        frozen, one above reshuffles). Under a distributed dataset each rank keeps only
        its own rows. ``cache(filename)`` (tf.data's on-disk cache) is refused: write the
        prepared rows once (``np.save``, HDF5) and read them with ``NpyDataset`` or
        ``HDF5Dataset``, which every rank reads its part of.

            >>> ds = Dataset.range(3).map(lambda x: x * 2).cache()
            >>> [int(x) for x in ds] == [int(x) for x in ds] == [0, 2, 4]
            True
        """
        if filename:
            raise NotImplementedError(
                f"cache({filename!r}): mpistrat caches in memory only (cache() without a "
                f"filename); for a copy on disk, write the prepared rows once (np.save, "
                f"HDF5) and read them with ms.data.NpyDataset or ms.data.HDF5Dataset")
        return self._wrap(Cache(self._node))

    def prefetch(self, buffer_size: int = 1) -> "Dataset":
        """Produce up to ``buffer_size`` elements ahead in a background thread
        (``AUTOTUNE``: 2)."""
        depth = 2 if buffer_size is None or buffer_size < 0 else max(int(buffer_size), 1)
        return self._wrap(ops.Prefetch(self._node, depth))

    def with_options(self, options: Options) -> "Dataset":
        """The same dataset carrying ``options`` (auto-shard policy and friends)."""
        return Dataset(node=self._node, options=options)

    def options(self) -> Options:
        return self._options

    # -- inspection ----------------------------------------------------------
    def cardinality(self) -> int:
        """The number of elements, ``INFINITE_CARDINALITY`` or ``UNKNOWN_CARDINALITY``."""
        return self._node.cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n < 0:
            raise TypeError("the dataset's length is " + ("infinite" if n == ops.INFINITE
                                                          else "unknown"))
        return n

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements as NumPy values (0-d arrays become NumPy scalars), as tf.data's."""
        return (nest.map_structure(_to_numpy, e) for e in self)

    @property
    def element_spec(self) -> Any:
        """``TensorSpec`` per component, read from the first element (batch dims vary).

        Reading it does not start an epoch (the shuffles' next order is unchanged)."""
        first = next(iter(self._node.elements(ops.Iteration((0,)))))
        vary = self._batch_size is not None and not self._drop_remainder
        return nest.map_structure(
            lambda x: TensorSpec(((None,) + np.shape(x)[1:]) if vary and np.ndim(x) else
                                 np.shape(x), _dtype_of(x)), first)


def _dtype_of(x) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def _to_numpy(x):
    array = np.asarray(x)
    return array[()] if array.ndim == 0 else array


def _lists_to_arrays(structure: Any) -> Any:
    """Dicts and tuples are structure, anything else one array; Python floats (and lists
    of them) become float32, as ``tf.constant`` makes them (NumPy arrays keep their dtype)."""
    if isinstance(structure, dict):
        return type(structure)((k, _lists_to_arrays(v)) for k, v in structure.items())
    if isinstance(structure, tuple):
        items = [_lists_to_arrays(v) for v in structure]
        return type(structure)(*items) if hasattr(structure, "_fields") else tuple(items)
    array = np.asarray(structure)
    if array.dtype == np.float64 and _python_numbers(structure):
        return array.astype(np.float32)
    return array


def _python_numbers(value: Any) -> bool:
    """Whether ``value`` is a Python number or (nested) list of them, not NumPy's."""
    if isinstance(value, np.generic):
        return False
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, list) and all(_python_numbers(v) for v in value)
