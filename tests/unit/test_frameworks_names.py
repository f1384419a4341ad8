"""The names a TensorFlow port reaches for (issue 16): ms.nn's loss scaling, ms.train.ClusterSpec,
ms.distribute.TPUStrategy and ReduceOp, the dataset helpers; their docstring examples run."""

import doctest
import importlib

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.errors import InvalidArgumentError


@pytest.mark.parametrize("module", ["mpistrat.nn", "mpistrat.cluster_spec", "mpistrat.train",
                                    "mpistrat.distribute"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed, result


def test_names_are_where_tensorflow_keeps_them():
    assert ms.distribute.TPUStrategy is ms.TPUStrategy
    assert ms.distribute.ReduceOp is ms.ReduceOp and ms.distribute.ReduceOp.MEAN.name == "MEAN"
    assert ms.train.ClusterSpec is ms.cluster_resolver.ClusterSpec
    assert callable(ms.nn.compute_average_loss) and callable(ms.nn.scale_regularization_loss)
    assert callable(ms.data.Dataset.as_numpy_iterator)
    from mpistrat.distribute.input_lib import DistributedDataset, DistributedIterator
    assert hasattr(DistributedDataset, "element_spec")
    assert callable(DistributedIterator.get_next_as_optional)


# -- compute_average_loss ------------------------------------------------------------------------
def test_average_loss_divides_by_the_global_batch_and_keeps_the_dtype():
    losses = np.array([1.0, 2.0, 3.0, 6.0], np.float32)
    out = ms.nn.compute_average_loss(losses, global_batch_size=8)
    assert out == np.float32(1.5) and out.dtype == np.float32
    assert ms.nn.compute_average_loss(losses) == np.float32(3.0)   # default: 4 rows x 1 replica
    assert ms.nn.compute_average_loss(np.ones((2, 3)), global_batch_size=np.int64(4)) == 1.5


@pytest.mark.parametrize("weight, want", [
    (2.0, 2 * 12.0 / 4),                              # a scalar weight
    (np.array([1.0, 0.0, 0.0, 1.0]), 7.0 / 4),        # one weight per example
    (np.array([[1.0], [0.0], [0.0], [1.0]]), 7.0 / 4)])  # with a trailing axis of 1
def test_sample_weight_follows_tensorflow(weight, want):
    losses = np.array([1.0, 2.0, 3.0, 6.0])
    assert ms.nn.compute_average_loss(losses, sample_weight=weight) == pytest.approx(want)


def test_sample_weight_per_example_on_a_2d_loss():
    losses = np.ones((2, 3))
    out = ms.nn.compute_average_loss(losses, sample_weight=np.array([1.0, 3.0]),
                                     global_batch_size=2)
    assert out == pytest.approx((3 * 1 + 3 * 3) / 2)


@pytest.mark.parametrize("size, match", [
    (0, "positive"), (-2, "positive"), (2.5, "integer"), (np.array([4, 4]), "scalar")])
def test_bad_global_batch_sizes_are_refused(size, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ms.nn.compute_average_loss(np.ones(2), global_batch_size=size)


def test_scalar_losses_and_unbroadcastable_weights_are_refused():
    with pytest.raises(ValueError, match="rank >= 1"):
        ms.nn.compute_average_loss(np.float32(1.0))
    with pytest.raises(InvalidArgumentError, match=r"sample_weight of shape \(3,\)"):
        ms.nn.compute_average_loss(np.ones(4), sample_weight=np.ones(3))


def test_jax_arrays_and_tracers_stay_jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    losses = jnp.arange(4.0, dtype=jnp.float32)
    out = ms.nn.compute_average_loss(losses, global_batch_size=8)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32 and float(out) == 0.75

    def mean_square(w):
        per_example = (jnp.arange(4.0) * w) ** 2
        return ms.nn.compute_average_loss(per_example, sample_weight=jnp.ones(4),
                                          global_batch_size=4)
    grad = jax.jit(jax.grad(mean_square))(jnp.float32(1.0))
    assert float(grad) == pytest.approx(2 * (0 + 1 + 4 + 9) / 4)
    assert float(jax.jit(ms.nn.scale_regularization_loss)(jnp.ones(3))) == 3.0


def test_cross_replica_context_needs_a_global_batch_size():
    strategy = ms.MirroredStrategy()          # one rank here
    with strategy.scope():
        with pytest.raises(RuntimeError, match="cross replica context"):
            ms.nn.compute_average_loss(np.ones(2))
        with pytest.raises(RuntimeError, match="cross replica context"):
            ms.nn.scale_regularization_loss(1.0)
        assert ms.nn.compute_average_loss(np.ones(2), global_batch_size=4) == 0.5


# -- ClusterSpec ---------------------------------------------------------------------------------
def test_cluster_spec_as_tensorflow():
    spec = ms.train.ClusterSpec({"worker": ["w0:2222", "w1:2222", "w2:2222"],
                                 "chief": ["c0:2222"], "ps": {1: "p1:2222", 4: "p4:2222"}})
    assert spec.jobs == ["chief", "ps", "worker"] and bool(spec)
    assert spec.num_tasks("worker") == 3 and spec.num_tasks("ps") == 2
    assert spec.task_indices("ps") == [1, 4] and spec.task_address("ps", 4) == "p4:2222"
    assert spec.job_tasks("ps") == [None, "p1:2222", None, None, "p4:2222"]
    assert spec.as_dict() == {"chief": ["c0:2222"], "ps": {1: "p1:2222", 4: "p4:2222"},
                              "worker": ["w0:2222", "w1:2222", "w2:2222"]}
    assert ms.train.ClusterSpec(spec) == spec and spec == spec.as_dict()
    assert spec != ms.train.ClusterSpec({"worker": ["w0:2222"]})
    assert not ms.train.ClusterSpec({})
    assert "ClusterSpec(" in repr(spec)


def test_cluster_spec_refuses_bad_input_naming_it():
    spec = ms.train.ClusterSpec({"worker": ["w0:1"]})
    with pytest.raises(ValueError, match="No such job in cluster: 'ps'"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match="No such task index 3 in job 'worker'"):
        spec.task_address("worker", 3)
    with pytest.raises(TypeError, match="job name"):
        ms.train.ClusterSpec({3: ["a:1"]})
    with pytest.raises(TypeError, match="tasks of job 'worker'"):
        ms.train.ClusterSpec({"worker": "a:1"})
    with pytest.raises(TypeError, match="task index -1"):
        ms.train.ClusterSpec({"worker": {-1: "a:1"}})
    with pytest.raises(TypeError, match="address 7"):
        ms.train.ClusterSpec({"worker": [7]})
    with pytest.raises(TypeError, match="must be a dict"):
        ms.train.ClusterSpec(["a:1"])


def test_resolvers_return_the_cluster_spec():
    spec = ms.cluster_resolver.MPIClusterResolver().cluster_spec()
    assert isinstance(spec, ms.train.ClusterSpec) and spec.num_tasks("worker") == 1
