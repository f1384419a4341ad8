"""How results are handed back to the user: rank-0 arrays become NumPy scalars.

    >>> import numpy as np
    >>> scalars_to_numpy({"loss": np.array(2.5), "w": np.ones(2)})
    {'loss': np.float64(2.5), 'w': array([1., 1.])}
"""

import operator
from typing import Any

import numpy as np

from mpistrat import nest

__all__ = ["scalars_to_numpy"]

_NDARRAY_ONLY = {np.ndarray}
_NDIM = operator.attrgetter("ndim")


def scalars_to_numpy(value: Any) -> Any:
    """Turn every 0-d NumPy array in a nest into a NumPy scalar."""
    if type(value) is np.ndarray:
        return value[()] if value.ndim == 0 else value
    if type(value) is list and set(map(type, value)) <= _NDARRAY_ONLY:  # the common result
        if 0 not in map(_NDIM, value):
            return value
        return [x[()] if x.ndim == 0 else x for x in value]
    leaves = nest.flatten(value)
    if not any(isinstance(x, np.ndarray) and x.ndim == 0 for x in leaves):
        return value
    return nest.map_structure(
        lambda x: x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x, value)
