"""The examples in the docstrings of TensorFlow's formats and their readers run as written."""

import doctest
import importlib

import pytest

MODULES = ["mpistrat.tfformats.crc", "mpistrat.tfformats.wire", "mpistrat.tfformats.messages",
           "mpistrat.tfformats.sstable", "mpistrat.tfformats.bundle",
           "mpistrat.tfformats.object_graph", "mpistrat.tfformats.records",
           "mpistrat.tfformats.record_index", "mpistrat.io.example", "mpistrat.io.records",
           "mpistrat.data.tfrecord", "mpistrat.checkpoint.tf_checkpoints"]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed, result
