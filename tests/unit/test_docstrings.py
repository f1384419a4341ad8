"""Every docstring example in the library runs as written (in one process, one rank).

A broken example is a broken promise to the reader; one that no longer parses (a line
without its ``>>>``) hides the examples after it. Modules whose examples other tests run
with their own checks (TensorFlow's formats, the names a port reaches for, the GPU
layers) run here too: this test asks only that each passes.
"""

import doctest
import importlib
import pkgutil

import pytest

import mpistrat

MODULES = sorted(m.name for m in pkgutil.walk_packages(mpistrat.__path__, "mpistrat.")
                 if not m.name.endswith("__main__"))


def test_every_module_is_found():
    assert {"mpistrat.collectives.dtypes", "mpistrat.collectives.deadline",
            "mpistrat.distribute.values", "mpistrat.runtime.abort"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run_as_written(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS,
                             report=False)
    assert not result.failed, f"{module}: {result.failed} of {result.attempted} examples failed"
