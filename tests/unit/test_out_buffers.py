"""``out_problem``: which ``out`` buffers an all-reduce may write its results into."""

import re

import numpy as np
import pytest

from mpistrat.collectives.out_buffers import out_problem, same_buffer


def test_in_place_distinct_buffers_and_views_of_one_buffer_are_accepted():
    x, y = np.ones(10), np.ones(4, np.int32)
    assert out_problem([x, y], [x, y]) is None
    assert out_problem((x, y), [np.empty(10), np.empty(4, np.int32)]) is None
    assert out_problem([x[:5], x[5:]], [x[:5], x[5:]]) is None    # disjoint views, in place
    assert out_problem([x, x], [np.empty(10), np.empty(10)]) is None  # inputs may repeat
    assert out_problem(x, x) is None


@pytest.mark.parametrize("value,out,text", [
    ([np.ones(3)], [np.ones(3, np.float32)], r"out\[0\] has shape \(3,\) and dtype float32"),
    ([np.ones(3)], [np.ones(6)[::2]], r"out\[0\] is not C-contiguous"),
    ([np.ones(3)], np.ones(3), "must be a list or tuple of 1"),
    ([np.ones(3), 2.0], [np.ones(3), np.ones(1)], "NumPy arrays only .*float"),
    (np.ones(3), [np.ones(3)], "out must be a NumPy array"),
    ([np.ones(3)], [[1.0, 2.0, 3.0]], r"out\[0\] is a list"),
])
def test_unusable_out_is_named(value, out, text):
    with pytest.raises(AssertionError):
        assert out_problem(value, out) is None
    assert re.search(text, out_problem(value, out))


def test_a_result_that_would_overwrite_a_value_still_to_be_read_is_refused():
    x = np.arange(10.0)
    a = np.zeros(10)
    assert "out[0] and out[1] overlap" in out_problem([x, x], [x, x])
    # (which of the two clashes is named first follows the buffers' addresses)
    assert re.search(r"(out\[0\] and input 1|input 0 and out\[1\]) overlap",
                     out_problem([x, a], [a, x]))
    assert "overlap" in out_problem([x[:6], x[4:]], [x[:6], x[4:]])
    read_only = np.ones(3)
    read_only.flags.writeable = False
    assert out_problem(read_only, read_only) == "out is read-only"


def test_same_buffer_is_the_input_element_for_element():
    x = np.arange(8.0)
    assert same_buffer(x, x) and same_buffer(x, x.reshape(2, 4).reshape(8))
    assert same_buffer(x.reshape(1, 8), x[None, :])          # size-1 dimensions' strides
    assert not same_buffer(x, x.copy())
    assert not same_buffer(x[::-1][::-1][::2], np.empty(4))   # a strided input is never in place
