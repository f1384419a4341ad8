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
    assert spec["x"].shape == (None, 2) and spec["y"].dtype == np.float64
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
