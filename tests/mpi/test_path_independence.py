"""The same inputs give the same numbers whichever way the engine takes (docs/collectives.md,
"Numbers that do not depend on the path"): the scalar and small-array folds that ride with the
validation probe, the general host path, the fused path of many tensors, each algorithm
(MPI's own, ring, Rabenseifner, reduce+broadcast), results into ``out``, validation off and
the timeline on. At 2 ranks every path gives the same bits (one addition rounds once, in
either order). Beyond, integers are the same everywhere, and floats differ only by the order
of their additions: each result lies within (N - 1) roundings of the exact sum,
``|result - exact| <= (N - 1) * eps * sum(|x_r|)`` (plus MEAN's one division), which this
test checks against a float64 reference for every path."""

import contextlib
import os

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine, CommunicationOptions
from mpistrat.runtime import timeline

pytestmark = pytest.mark.numpy_only("host buffers through every host path")

ALGORITHMS = ("mpi", "ring", "rabenseifner", "reduce_broadcast")


@contextlib.contextmanager
def environment(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def inputs(rank, dtype, size):
    """Values whose float sums round differently in different orders (mixed magnitudes)."""
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size).astype(dtype)
    return (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(dtype)


def paths(world, value, op):
    """Every way of asking for the same all-reduce: name -> result."""
    comm = world.comm
    engine = CollectiveEngine(comm.Dup())
    out = {"default": engine.all_reduce(value, op),
           "options given": engine.all_reduce(value, op, CommunicationOptions()),
           "fused with 40 others": engine.all_reduce(
               [value] + [np.ones(16, value.dtype)] * 40, op)[0],
           "into out": engine.all_reduce(value, op, out=np.empty_like(value)),
           "as a list": engine.all_reduce([value], op)[0]}
    if value.ndim == 0 and value.dtype == np.float64:   # (a Python float is a float64)
        out["a Python float"] = engine.all_reduce(value.item(), op)
    for algorithm in ALGORITHMS:
        out[f"algorithm {algorithm}"] = engine.all_reduce(
            value, op, CommunicationOptions(algorithm=algorithm))
    timeline.enable(None)
    try:
        out["timeline on"] = engine.all_reduce(value, op)
    finally:
        timeline.disable()
    with environment("MPISTRAT_VALIDATE", "0"):
        unvalidated = CollectiveEngine(comm.Dup())
    out["validation off"] = unvalidated.all_reduce(value, op)
    out["validation off, fused"] = unvalidated.all_reduce([value] * 3, op)[1]
    return {name: np.asarray(result) for name, result in out.items()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("size", [0, 8, 11, 70000])   # 0: a scalar; 70000: past the ring
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_every_path_gives_the_same_numbers(world, dtype, size, op):
    if op == "MEAN" and dtype == "int32":
        pytest.skip("an integer MEAN is its SUM divided: covered by SUM")
    value = inputs(world.rank, dtype, size) if size else inputs(world.rank, dtype, 1)[0:1]
    value = value.reshape(()) if size == 0 else value
    results = paths(world, value, op)
    for name, result in results.items():
        assert result.dtype == value.dtype and result.shape == value.shape, name
    everyone = np.stack(world.comm.allgather(value)).astype(np.float64)
    exact = everyone.sum(axis=0) / (world.size if op == "MEAN" else 1)
    if world.size == 2 or value.dtype.kind == "i":
        first = next(iter(results.values()))
        different = [n for n, r in results.items() if r.tobytes() != first.tobytes()]
        assert different == [], f"paths that differ in their bits: {different}"
        if value.dtype.kind == "i":
            np.testing.assert_array_equal(first, exact.astype(value.dtype))
    eps = np.finfo(value.dtype).eps if value.dtype.kind == "f" else 0
    scale = np.abs(everyone).sum(axis=0) / (world.size if op == "MEAN" else 1)
    bound = (world.size - 1 + (op == "MEAN") + 1) * eps * scale
    for name, result in results.items():
        error = np.abs(result.astype(np.float64) - exact)
        assert (error <= bound).all(), (name, float((error - bound).max()))


@pytest.mark.mpi(min_size=2)
def test_strategy_reduce_gives_the_engines_numbers(strategy, world):
    """``strategy.reduce`` of a loss (the folded scalar path) and of an array of 11 values
    (the general one) give the engine's bits."""
    engine = CollectiveEngine(world.comm.Dup())
    for value in (inputs(world.rank, "float32", 1).reshape(()), inputs(world.rank, "float32", 11)):
        for op in ("SUM", "MEAN"):
            ours = np.asarray(strategy.reduce(op, value, axis=None))
            theirs = np.asarray(engine.all_reduce(value, op))
            assert ours.tobytes() == theirs.tobytes() and ours.dtype == value.dtype, op
