"""``TensorSpec``: what one component of a dataset's elements is, as tf.data describes it::

    >>> import numpy as np
    >>> from mpistrat.data.specs import TensorSpec
    >>> TensorSpec((None, 28), np.dtype(np.float32))
    TensorSpec(shape=(None, 28), dtype=dtype('float32'))
"""

from typing import NamedTuple

import numpy as np

__all__ = ["TensorSpec"]


class TensorSpec(NamedTuple):
    """Shape (``None`` for a dimension that varies) and dtype of one component."""

    shape: tuple
    dtype: np.dtype
