"""ms.data.Dataset transformations in one process."""

import numpy as np
import pytest

from mpistrat.data import Dataset
from mpistrat.data.rebatch import rebatch_slices


def values(ds):
    return [np.asarray(x).tolist() for x in ds]


@pytest.mark.parametrize("rows,replicas", [(5, 2), (5, 4), (4, 4), (6, 4), (0, 3), (1, 3)])
def test_rebatch_slices_cover_rows_in_order(rows, replicas):
    slices = rebatch_slices(rows, replicas)
    assert slices[0][0] == 0 and slices[-1][1] == rows and len(slices) == replicas
    sizes = [b - a for a, b in slices]
    assert all(s <= -(-rows // replicas) for s in sizes)
    assert sizes == sorted(sizes, reverse=True)


def test_sources_and_transformations():
    assert values(Dataset.range(2, 8, 2)) == [2, 4, 6]
    assert values(Dataset.range(7).batch(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert values(Dataset.range(7).batch(3, drop_remainder=True)) == [[0, 1, 2], [3, 4, 5]]
    assert values(Dataset.range(5).batch(2).unbatch()) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(5).map(lambda x: x * 10).filter(lambda x: x > 10)) == [20, 30, 40]
    assert values(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(Dataset.range(10).skip(2).take(3)) == [2, 3, 4]
    assert values(Dataset.range(10).shard(3, 1)) == [1, 4, 7]
    assert [(int(i), int(x)) for i, x in Dataset.range(3, 6).enumerate()] == [(0, 3), (1, 4), (2, 5)]
    assert values(Dataset.range(50).prefetch(4)) == list(range(50))
    pairs = Dataset.zip((Dataset.range(3), Dataset.range(10, 20)))
    assert [(int(a), int(b)) for a, b in pairs] == [(0, 10), (1, 11), (2, 12)]
    with pytest.raises(ValueError):
        Dataset.range(3).shard(2, 2)


def test_from_tensor_slices_nests_and_element_spec():
    ds = Dataset.from_tensor_slices({"x": np.arange(6).reshape(3, 2), "y": [1.0, 2.0, 3.0]})
    first = next(iter(ds))
    assert first["x"].tolist() == [0, 1] and first["y"] == 1.0
    spec = ds.batch(2).element_spec
    assert spec["x"].shape == (None, 2) and spec["y"].dtype == np.float32  # (tf.constant)
    with pytest.raises(ValueError, match="same number of rows"):
        Dataset.from_tensor_slices((np.zeros(2), np.zeros(3)))


def test_shuffle_is_deterministic_for_a_seed_and_a_permutation():
    ds = Dataset.range(20).shuffle(8, seed=3)
    first, second = values(ds), values(ds)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert first != second  # reshuffled each iteration
    fixed = Dataset.range(20).shuffle(8, seed=3, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    assert values(Dataset.range(20).shuffle(8, seed=3)) == first


def test_prefetch_reraises_producer_errors():
    def boom(x):
        if int(x) == 3:
            raise RuntimeError("bad element 3")
        return x
    with pytest.raises(RuntimeError, match="bad element 3"):
        list(Dataset.range(5).map(boom).prefetch(2))


class Counting:
    """A map function that counts its calls (one per element it computes)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 10


@pytest.mark.parametrize("planned", [True, False])
def test_cache_computes_each_element_once_and_freezes_a_shuffle_below_it(planned):
    square = Counting()
    base = Dataset.range(12) if planned else Dataset(lambda: iter(np.arange(12)))
    cached = base.shuffle(12, seed=3).map(square).cache()
    assert (cached._node.blocker() is None) == planned
    epochs = [values(cached) for _ in range(3)]
    assert epochs[0] == epochs[1] == epochs[2] and sorted(epochs[0]) == list(range(0, 120, 10))
    assert square.calls == 12                              # the map ran once per element
    uncached = values(base.shuffle(12, seed=3).map(lambda x: x * 10))
    assert epochs[0] == uncached                           # the first iteration's elements


def test_cache_below_a_reshuffle_gives_a_new_order_of_the_same_elements_each_epoch():
    square = Counting()
    dataset = Dataset.range(50).map(square).cache().shuffle(50, seed=1)
    first, second = values(dataset), values(dataset)
    assert first != second and sorted(first) == sorted(second) == list(range(0, 500, 10))
    assert square.calls == 50
    plain = Dataset.range(50).map(lambda x: x * 10).shuffle(50, seed=1)
    assert [first, second] == [values(plain), values(plain)]    # transparent to the order


def test_cache_keeps_nothing_from_an_iteration_abandoned_midway():
    square = Counting()
    dataset = Dataset(lambda: iter(range(6))).map(square).cache()
    iterator = iter(dataset)
    assert [next(iterator), next(iterator)] == [0, 10]
    assert values(dataset) == [0, 10, 20, 30, 40, 50] and square.calls == 8
    assert values(dataset) == [0, 10, 20, 30, 40, 50] and square.calls == 8


@pytest.mark.parametrize("planned", [True, False])
def test_cached_batches_cannot_be_changed_by_the_caller(planned):
    base = Dataset.range(7) if planned else Dataset(lambda: iter(np.arange(7)))
    dataset = base.batch(3).cache().repeat(2)
    assert values(dataset) == [[0, 1, 2], [3, 4, 5], [6]] * 2
    batch = next(iter(dataset))
    with pytest.raises(ValueError, match="read-only"):
        batch[:] = -1                                      # tf.data's tensors are immutable
    assert values(dataset) == [[0, 1, 2], [3, 4, 5], [6]] * 2


def test_cache_to_a_file_is_refused_with_the_alternative():
    with pytest.raises(NotImplementedError, match="NpyDataset"):
        Dataset.range(3).cache("/tmp/cache")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_vectorized_map_before_batch_that_returns_a_sparse_batch_is_refused(workers):
    """parse_example's VarLenFeature gives one SparseTensorValue for the rows it was given:
    cut into pieces and joined again (threads, chunks) it became garbage (a dense_shape of
    [4, 3, 4, 3]); now it is a ValueError naming the way out."""
    import mpistrat as ms
    records = np.array([ms.io.serialize_example({"t": list(range(i % 3 + 1))})
                        for i in range(40)], dtype=object)
    features = {"t": ms.io.VarLenFeature("int64")}
    parse = lambda r: ms.io.parse_example(r, features)  # noqa: E731
    before = Dataset.from_tensor_slices(records).map(parse, vectorized=True,
                                                      num_parallel_calls=workers).batch(8)
    with pytest.raises(ValueError, match="parse after batch"):
        list(before)
    after = Dataset.from_tensor_slices(records).batch(40).map(parse, vectorized=True,
                                                              num_parallel_calls=workers)
    batch = next(iter(after))["t"]
    assert batch.dense_shape.tolist() == [40, 3] and len(batch.values) == 79


def test_a_cached_map_after_batch_runs_once_per_batch_even_to_count_rows():
    """Before, every epoch asked the map below for each batch's size, which ran it again."""
    square = Counting()
    dataset = Dataset.range(40).batch(2).map(square).cache()   # (not vectorized: whole batches)
    first, second = values(dataset), values(dataset)
    assert first == second and len(first) == 20
    assert square.calls <= 20 + 16      # the first epoch's look-ahead, then nothing


def test_two_iterators_of_one_cached_dataset_at_once_get_the_same_rows():
    import threading
    dataset = Dataset.range(3000).map(lambda x: x * 3).cache().batch(7).prefetch(4)
    got = {}

    def run(name):
        got[name] = values(dataset)
    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    want = values(Dataset.range(3000).map(lambda x: x * 3).batch(7))
    assert got[0] == got[1] == got[2] == want


def test_a_vectorized_map_whose_rows_depend_on_the_group_is_refused_whatever_the_threads():
    """A FixedLenSequenceFeature pads to the longest row of each call: before batch, on
    several threads, the pieces came back with other widths and failed deep in concatenate
    (and on one thread the widths depended on the read group); now it is named."""
    import mpistrat as ms
    records = np.array([ms.io.serialize_example({"t": list(range(i % 5 + 1))})
                        for i in range(64)], dtype=object)
    dense = {"t": ms.io.FixedLenSequenceFeature([], "int64", allow_missing=True)}
    parse = lambda r: ms.io.parse_example(r, dense)  # noqa: E731
    with pytest.raises(ValueError, match="other shapes for other groups"):
        list(Dataset.from_tensor_slices(records).map(parse, vectorized=True,
                                                     num_parallel_calls=4).batch(8))
    after = next(iter(Dataset.from_tensor_slices(records).batch(64).map(parse, vectorized=True)))
    assert after["t"].shape == (64, 5)
