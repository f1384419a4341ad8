"""The small tf.data idioms a TensorFlow user writes, at every width (issue 44):
``Dataset.from_tensors``, ``Dataset.from_generator`` with ``output_signature`` (each element
converted to it, a misfit named), Python floats as float32 (``tf.constant``'s rule; NumPy
arrays keep their dtype), ``get_next()`` past the end raising ``ms.errors.OutOfRangeError``
on every rank at the same step and ``get_next_as_optional()`` empty there, and a
``PerReplica`` handed straight to JAX refused by name."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import Dataset, TensorSpec

pytestmark = pytest.mark.numpy_only("datasets of NumPy rows built here")


@pytest.mark.mpi(min_size=1)
def test_from_tensors_is_one_element_and_python_floats_are_float32(world):
    assert [e.tolist() for e in Dataset.from_tensors([1.5, 2.5])] == [[1.5, 2.5]]
    (element,) = list(Dataset.from_tensors({"a": 0.5, "b": np.arange(3.0)}))
    assert element["a"].dtype == np.float32 and element["b"].dtype == np.float64
    assert next(iter(Dataset.from_tensor_slices([0.1, 0.2]))).dtype == np.float32
    assert next(iter(Dataset.from_tensor_slices(np.array([0.1])))).dtype == np.float64
    assert float(next(iter(Dataset.from_tensor_slices([0.1])))) == float(np.float32(0.1))


def gen():
    for i in range(11):
        yield {"x": [float(i), i * 2.0], "y": i}


SIGNATURE = {"x": TensorSpec((2,), np.float32), "y": TensorSpec((), np.int64)}


@pytest.mark.mpi(min_size=1)
def test_from_generator_distributed_gives_the_rows_of_the_same_slices(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    made = Dataset.from_generator(gen, output_signature=SIGNATURE).batch(4)
    same = Dataset.from_tensor_slices({"x": np.array([[i, 2 * i] for i in range(11)],
                                                     np.float32),
                                       "y": np.arange(11, dtype=np.int64)}).batch(4)
    assert made.element_spec["x"].dtype == np.float32
    for _ in range(2):   # (a new generator call each epoch)
        got = list(strategy.experimental_distribute_dataset(made))
        want = list(strategy.experimental_distribute_dataset(same))
        assert len(got) == len(want) == 3
        for a, b in zip(got, want):
            (a,), (b,) = strategy.experimental_local_results(a), \
                strategy.experimental_local_results(b)
            assert a["x"].dtype == np.float32 and a["y"].dtype == np.int64
            np.testing.assert_array_equal(a["x"], b["x"])
            np.testing.assert_array_equal(a["y"], b["y"])


@pytest.mark.mpi(min_size=1)
def test_from_generator_names_an_element_that_does_not_fit(world):
    def bad():
        yield {"x": [1.0, 2.0], "y": 1}
        yield {"x": [1.0, 2.0, 3.0], "y": 2}
    with pytest.raises(ms.errors.InvalidArgumentError, match=r"element 1 whose component "
                       r"\['x'\] has shape \(3,\) where an element of shape \(2,\)"):
        list(Dataset.from_generator(bad, output_signature=SIGNATURE))
    with pytest.raises(ms.errors.InvalidArgumentError, match="could not be converted"):
        list(Dataset.from_generator(lambda: iter([{"x": [1, 2], "y": 1.5}]),
                                    output_signature=SIGNATURE))
    with pytest.raises(ms.errors.InvalidArgumentError, match="did not match the expected"):
        list(Dataset.from_generator(lambda: iter([{"x": [1, 2]}]),
                                    output_signature=SIGNATURE))
    old = Dataset.from_generator(lambda: iter([(1, [2.0])]), output_types=(np.int32, np.float32),
                                 output_shapes=((), (None,)))
    (first,) = list(old)
    assert first[0].dtype == np.int32 and first[1].tolist() == [2.0]


@pytest.mark.mpi(min_size=1)
def test_get_next_past_the_end_raises_out_of_range_on_every_rank(world):
    strategy = ms.MultiWorkerMirroredStrategy()
    iterator = iter(strategy.experimental_distribute_dataset(Dataset.range(10).batch(4)))
    steps = [iterator.get_next() for _ in range(3)]
    assert len(steps) == 3
    assert not iterator.get_next_as_optional().has_value()
    with pytest.raises(ms.errors.OutOfRangeError, match="End of sequence"):
        iterator.get_next()
    assert issubclass(ms.errors.OutOfRangeError, ms.errors.OpError)


@pytest.mark.mpi(min_size=1)
def test_a_per_replica_handed_to_jax_is_refused_naming_run(world):
    jnp = pytest.importorskip("jax.numpy")
    strategy = ms.MultiWorkerMirroredStrategy()
    batch = next(iter(strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices(np.ones((8, 2), np.float32)).batch(4))))
    with pytest.raises(TypeError, match=r"strategy.run\(step.*experimental_local_results"):
        jnp.asarray(batch) @ jnp.ones(2)          # the batch straight into a JAX step
    (mine,) = strategy.experimental_local_results(batch)
    assert (jnp.asarray(mine) @ jnp.ones(2)).shape == (len(mine),)
