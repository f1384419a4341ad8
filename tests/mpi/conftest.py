"""Fixtures for the multi-rank tests (run under mpirun with --with-mpi).

The array-kind switch: ``MPISTRAT_TEST_ARRAYS=numpy|jax|cupy`` (default numpy) makes the tests
that take the ``arrays`` fixture build their replica values, variables and expected results
with that array module, and check that results come back as the same kind::

    def test_sum(strategy, world, arrays):
        out = strategy.reduce("SUM", arrays.asarray(np.ones(3)), axis=None)
        arrays.assert_equal(out, arrays.xp.full(3, world.size))   # kind and values

In a run with another kind than NumPy, a test without the ``arrays`` fixture is skipped: with
the reason of its ``numpy_only`` marker (file readers, raw MPI comparisons, host-buffer
algorithms), or as using no array of the run's kind.
"""

import contextlib

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.runtime import get_world, settings
from mpistrat.runtime.devices import array_kind

KIND = settings.get("MPISTRAT_TEST_ARRAYS")


def _module(kind: str):
    if kind == "jax":
        import jax
        jax.config.update("jax_enable_x64", True)   # the suite's float64/int64 stay 64-bit
        import jax.numpy as jnp
        return jnp
    if kind == "cupy":
        import cupy
        return cupy
    return np


class Arrays:
    """The array kind of this run: ``xp`` builds values, ``numpy`` brings results back."""

    def __init__(self, kind: str):
        self.kind, self.xp = kind, _module(kind)

    def asarray(self, value, dtype=None):
        """``value`` (a NumPy array, scalar or list) as an array of this kind."""
        return self.xp.asarray(np.asarray(value, dtype=dtype))

    def tree(self, value):
        """Every NumPy array or scalar leaf of a dict/list/tuple nest as this kind."""
        if isinstance(value, dict):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.tree(v) for v in value)
        return self.asarray(value) if isinstance(value, (np.ndarray, np.generic)) else value

    def numpy(self, value) -> np.ndarray:
        """A result of any kind as a NumPy array (copied to the host for CuPy)."""
        if array_kind(value) == "cupy":
            return value.get()
        return np.asarray(value)

    def assert_kind(self, value) -> None:
        """Every array leaf of ``value`` is of this run's kind."""
        if isinstance(value, (dict, list, tuple)):
            for leaf in (value.values() if isinstance(value, dict) else value):
                self.assert_kind(leaf)
            return
        kind = array_kind(value)
        assert kind == self.kind, f"{type(value).__module__}.{type(value).__name__} " \
                                  f"came back, not a {self.kind} array"

    def assert_equal(self, actual, expected, dtype=None) -> None:
        """``actual`` is of this kind, with ``expected``'s values (and ``dtype``, if given)."""
        self.assert_kind(actual)
        np.testing.assert_array_equal(self.numpy(actual), self.numpy(expected))
        if dtype is not None:
            assert self.numpy(actual).dtype == np.dtype(dtype), self.numpy(actual).dtype

    @contextlib.contextmanager
    def gap(self, reason: str):
        """A known gap of other kinds than NumPy, waiting for a named fix: a failure inside
        the block is an expected failure (xfail) in those runs, a failure in NumPy runs."""
        try:
            yield
        except (AssertionError, ValueError, TypeError) as err:
            if self.kind == "numpy":
                raise
            pytest.xfail(f"{reason} ({type(err).__name__}: {str(err)[:160]})")

    def assert_close(self, actual, expected, rtol=1e-7, dtype=None) -> None:
        self.assert_kind(actual)
        np.testing.assert_allclose(self.numpy(actual), self.numpy(expected), rtol=rtol)
        if dtype is not None:
            assert self.numpy(actual).dtype == np.dtype(dtype), self.numpy(actual).dtype


def pytest_configure(config):
    config.addinivalue_line("markers", "numpy_only(reason): the test is inherently NumPy "
                                       "(skipped when MPISTRAT_TEST_ARRAYS is another kind)")


def pytest_collection_modifyitems(config, items):
    if KIND == "numpy":
        return
    for item in items:
        if "arrays" in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("numpy_only")
        reason = marker.args[0] if marker and marker.args else \
            "uses no array of the run's kind (NumPy values or Python numbers only)"
        item.add_marker(pytest.mark.skip(reason=f"NumPy only: {reason}"))


def pytest_report_header(config):
    return [f"replica arrays: {KIND} (MPISTRAT_TEST_ARRAYS)"]


@pytest.fixture(scope="session")
def arrays():
    return Arrays(KIND)


@pytest.fixture
def world():
    return get_world()


@pytest.fixture
def strategy():
    return ms.MultiWorkerMirroredStrategy()
