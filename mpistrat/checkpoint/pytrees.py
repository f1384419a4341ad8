"""JAX values in a checkpoint's object graph: arrays, and containers rebuilt on restore.

JAX arrays are immutable, and so are tuples, NamedTuples (optax states), ``flax.struct``
dataclasses and most registered pytree nodes: a restore cannot write into them. Their
values are restored by *rebuilding* them and rebinding the new object on the parent that
holds it (a dict item, a list item, an attribute, the ``Checkpoint`` attribute itself).
``Rebuild`` is one such immutable node; each child's restored value is put in its slot
of ``children``, and ``SlotMap.finish`` rebuilds the changed nodes deepest first, so a
tuple inside a NamedTuple inside a dict ends as one new tree of the same treedef.

Nothing here imports JAX: a value is a JAX array or pytree node only if JAX is already
imported by the program (``sys.modules``), so NumPy-only programs never pay for it.

    >>> import jax.numpy as jnp
    >>> from mpistrat.checkpoint.pytrees import node_children
    >>> children, rebuild = node_children((jnp.zeros(2), 3))
    >>> [name for name, _, _ in children], rebuild([1, 2])
    (['0', '1'], (1, 2))
"""

import sys
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

__all__ = ["is_jax_array", "jax_read", "jax_rebuilt", "node_children", "Rebuild",
           "readonly_rebuilt", "saved_kind", "as_saved"]


def _jax():
    return sys.modules.get("jax")


def is_jax_array(obj: Any) -> bool:
    """A ``jax.Array`` (only when the program has imported JAX)."""
    jax = _jax()
    return jax is not None and isinstance(obj, jax.Array)


def _is_key(array) -> bool:
    jax = _jax()
    return jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key)


def jax_read(array) -> np.ndarray:
    """A host copy of a JAX array; a typed PRNG key array saves its raw key data."""
    jax = _jax()
    if _is_key(array):
        array = jax.random.key_data(array)
    return np.asarray(array)


def jax_rebuilt(original, value: np.ndarray):
    """A new JAX array holding ``value``, placed as ``original`` was (the same devices and
    sharding; uncommitted if it was), a PRNG key of the same implementation for keys."""
    jax = _jax()
    value = np.asarray(value)
    if getattr(original, "committed", True):
        new = jax.device_put(value, original.sharding)
    else:
        new = jax.device_put(value)
    if _is_key(original):
        new = jax.random.wrap_key_data(new, impl=jax.random.key_impl(original))
    return new


def jax_shape_dtype(array) -> Tuple[tuple, np.dtype]:
    """The shape and dtype a JAX array is saved with (raw key data for PRNG keys)."""
    if _is_key(array):
        data = _jax().random.key_data(array)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(array.shape), np.dtype(array.dtype)


def saved_kind(slot) -> str:
    """The kind a slot is saved with: ``array:jax`` for a JAX array, so that a restore into
    a Python number (a fresh Flax ``TrainState.step`` is ``0``) gives a JAX array again."""
    return "array:jax" if slot.kind == "array" and is_jax_array(slot.owner) else slot.kind


def as_saved(value: np.ndarray, array_type: str):
    """A scalar read from a file as the type it was saved from: a JAX array (when the
    program has imported JAX) or a NumPy scalar, of the saved dtype.

        >>> as_saved(np.asarray(5, np.int32), "")
        np.int32(5)
    """
    jax = _jax()
    if array_type == "jax" and jax is not None:
        return jax.numpy.asarray(value)
    return np.asarray(value)[()]


def readonly_rebuilt(value: np.ndarray) -> np.ndarray:
    """A read-only NumPy array is restored as a new read-only array."""
    new = np.array(value, copy=True)
    new.flags.writeable = False
    return new


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_attribute_key(key) -> bool:
    """Children keyed by attribute name (NamedTuple fields, dataclass fields, Equinox
    module fields) follow the rules of an object's attributes."""
    return type(key).__name__ == "GetAttrKey"


def node_children(obj: Any) -> Optional[Tuple[List[Tuple[str, Any]], Callable[[list], Any]]]:
    """``([(name, child, by_attribute), ...], rebuild(children))`` for a tuple or a
    registered pytree node (one level only), else ``None``. Names are JAX's key names
    (field names, indices, dict keys); ``by_attribute`` is true for a child keyed by
    attribute name (a dataclass or module field)."""
    jax = _jax()
    if jax is None:
        if isinstance(obj, tuple):
            make = (lambda c: type(obj)(*c)) if hasattr(obj, "_fields") else \
                (lambda c: type(obj)(c))
            names = list(obj._fields) if hasattr(obj, "_fields") else \
                [str(i) for i in range(len(obj))]
            return [(n, c, hasattr(obj, "_fields")) for n, c in zip(names, obj)], make
        return None
    try:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    except Exception:  # noqa: BLE001 - a node whose flatten fails is not a pytree to us
        return None
    if treedef.num_nodes == 1 and treedef.num_leaves == 1 and not isinstance(obj, tuple):
        return None   # a leaf: not a registered node
    children = [(_key_name(path[-1]), child, is_attribute_key(path[-1]))
                for path, child in pairs]
    return children, treedef.unflatten


class Rebuild:
    """An immutable node of the graph: its children, changed ones replaced on restore."""

    def __init__(self, children: list, make: Callable[[list], Any], setter, depth: int):
        self.children, self.make, self.setter, self.depth = list(children), make, setter, depth
        self.dirty = False

    def child_setter(self, index: int):
        def put(value):
            self.children[index] = value
            self.dirty = True
        return put

    def rebuild(self) -> None:
        """Build the new node and rebind it on its parent (a no-op without a parent)."""
        if self.dirty and self.setter is not None:
            self.setter(self.make(self.children))
        self.dirty = False
