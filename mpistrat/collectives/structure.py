"""The structure of a collective's value: what is a tensor and what is a container.

Dicts, lists, tuples and namedtuples are walked as ``mpistrat.nest`` walks them.
Any JAX pytree node (``jax.tree_util`` registered classes: ``nnx.State``,
``flax.struct`` dataclasses, Equinox modules, custom nodes) is structure too,
not a leaf: when one appears, the whole value is flattened by
``jax.tree_util`` and rebuilt into the same treedef. JAX is never imported
here; its registry is asked only when a value holds something that is
neither a container nor an array::

    >>> import numpy as np
    >>> from mpistrat.collectives.structure import flatten, leaf_names
    >>> leaves, rebuild = flatten({"b": [np.ones(2), 3.0], "a": np.zeros(1)})
    >>> len(leaves), rebuild([1, 2, 3])
    (3, {'a': 1, 'b': [2, 3]})
    >>> leaf_names({"b": [np.ones(2), 3.0], "a": np.zeros(1)})
    ["['a']", "['b'][0]", "['b'][1]"]
"""

import operator
import sys
from typing import Any, Callable, List, Tuple

import numpy as np

from mpistrat import nest
from mpistrat.collectives.dtypes import dtype_code
from mpistrat.runtime.devices import array_kind

__all__ = ["flatten", "leaf_names", "is_tensor", "signature_of", "gather_signature",
           "axis_or_none"]

_SCALARS = (float, int, complex, bool, np.ndarray, np.generic)


def is_tensor(value: Any) -> bool:
    """A leaf a collective combines: an array of any kind, or a number."""
    return isinstance(value, _SCALARS) or array_kind(value) != "numpy"


def _pytree_node(value: Any) -> bool:
    """Whether JAX (when already imported) flattens ``value`` into children."""
    if value is None or is_tensor(value) or "jax" not in sys.modules:
        return False
    import jax
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return not (len(leaves) == 1 and leaves[0] is value)


def _needs_jax(value: Any) -> bool:
    if not isinstance(value, (dict, list, tuple)):
        return _pytree_node(value)
    return any(not is_tensor(leaf) and _pytree_node(leaf) for leaf in nest.flatten(value))


def flatten(value: Any) -> Tuple[List[Any], Callable[[List[Any]], Any]]:
    """``(leaves, rebuild)``: ``rebuild(new_leaves)`` is ``value``'s structure around them."""
    if _needs_jax(value):
        import jax
        leaves, treedef = jax.tree_util.tree_flatten(value)
        return leaves, treedef.unflatten
    if isinstance(value, (dict, list, tuple)):
        return nest.flatten(value), lambda leaves: nest.pack_sequence_as(value, leaves)
    return [value], _first


def _first(leaves: List[Any]) -> Any:
    return leaves[0]


def leaf_names(value: Any) -> List[str]:
    """The path of every leaf of ``value``, in ``flatten``'s order (``"['w'][0]"``;
    ``"value"`` for a lone tensor). For error messages: not on any fast path."""
    if _needs_jax(value):
        import jax
        pairs, _ = jax.tree_util.tree_flatten_with_path(value)
        return [jax.tree_util.keystr(path) or "value" for path, _ in pairs]
    names: List[str] = []
    _walk(value, "", names)
    return names or ["value"]


def _walk(value: Any, prefix: str, names: List[str]) -> None:
    if isinstance(value, dict):
        for key in nest._sorted_keys(value):
            _walk(value[key], f"{prefix}[{key!r}]", names)
    elif isinstance(value, (list, tuple)):
        fields = getattr(value, "_fields", None)
        for index, item in enumerate(value):
            _walk(item, f"{prefix}.{fields[index]}" if fields else f"{prefix}[{index}]", names)
    else:
        names.append(prefix or "value")


_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
_NDARRAY_ONLY = {np.ndarray}


def signature_of(arrays) -> tuple:
    """``(dtype, shape)`` per tensor, built in C (``map``): the key of every cache. Device
    arrays also carry their kind (ranks that mix NumPy and CuPy would pick different backends)."""
    signature = tuple(map(_DTYPE_SHAPE, arrays))
    if set(map(type, arrays)) <= _NDARRAY_ONLY:
        return signature
    kinds = [array_kind(a) for a in arrays]
    if all(kind == "numpy" for kind in kinds):
        return signature
    return tuple((dtype if kind == "numpy" else f"{dtype_code(dtype)}@{kind}", tuple(shape))
                 for kind, (dtype, shape) in zip(kinds, signature))


def axis_or_none(axis: int, ndim: int):
    """``axis`` normalised into ``[0, ndim)``, or ``None`` when out of range::

        >>> axis_or_none(-1, 3), axis_or_none(3, 3)
        (2, None)
    """
    if -ndim <= axis < ndim:
        return axis % ndim
    return None


def gather_signature(arrays, axis: int) -> tuple:
    """``signature_of`` for a gather along ``axis``: that dimension masked (-1, it may differ
    between ranks), device arrays with their kind."""
    return tuple((dtype_code(a.dtype) if type(a) is np.ndarray else
                  f"{dtype_code(a.dtype)}@{array_kind(a)}".replace("@numpy", ""),
                  tuple(-1 if d == axis_or_none(axis, a.ndim) else n
                        for d, n in enumerate(a.shape))) for a in arrays)
