"""Flatten and rebuild nested structures of values, as ``tf.nest`` does.

Dicts (keys in sorted order), lists, tuples and namedtuples are structure;
everything else, arrays and scalars included, is a leaf::

    >>> from mpistrat import nest
    >>> leaves = nest.flatten({"b": [1, 2], "a": 3})
    >>> leaves
    [3, 1, 2]
    >>> nest.pack_sequence_as({"b": [0, 0], "a": 0}, [x * 10 for x in leaves])
    {'a': 30, 'b': [10, 20]}
"""

from typing import Any, Callable, Iterator, List, Sequence

__all__ = ["flatten", "pack_sequence_as", "map_structure", "is_nested"]


def is_nested(value: Any) -> bool:
    """True for the containers that ``flatten`` walks into."""
    return isinstance(value, (dict, list, tuple))


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _sorted_keys(mapping: dict) -> list:
    try:
        return sorted(mapping)
    except TypeError:  # keys of mixed types: fall back to insertion order
        return list(mapping)


def flatten(structure: Any) -> List[Any]:
    """Return the leaves of ``structure`` in a deterministic order."""
    return list(_iter_leaves(structure))


def _iter_leaves(structure: Any) -> Iterator[Any]:
    if isinstance(structure, dict):
        for key in _sorted_keys(structure):
            yield from _iter_leaves(structure[key])
    elif isinstance(structure, (list, tuple)):
        for item in structure:
            yield from _iter_leaves(item)
    else:
        yield structure


def pack_sequence_as(structure: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild ``structure`` with ``leaves`` in place of its own leaves."""
    iterator = iter(leaves)
    result = _pack(structure, iterator)
    leftover = sum(1 for _ in iterator)
    if leftover:
        raise ValueError(f"pack_sequence_as: {leftover} leaves more than the structure holds")
    return result


def _pack(structure: Any, leaves: Iterator[Any]) -> Any:
    if isinstance(structure, dict):
        return type(structure)((key, _pack(structure[key], leaves)) for key in _sorted_keys(structure))
    if isinstance(structure, (list, tuple)):
        items = [_pack(item, leaves) for item in structure]
        if _is_namedtuple(structure):
            return type(structure)(*items)
        return type(structure)(items)
    try:
        return next(leaves)
    except StopIteration:
        raise ValueError("pack_sequence_as: fewer leaves than the structure holds") from None


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``fn`` to the matching leaves of one or more structures."""
    flat = [flatten(s) for s in structures]
    if any(len(f) != len(flat[0]) for f in flat):
        raise ValueError("map_structure: the structures have different numbers of leaves")
    return pack_sequence_as(structures[0], [fn(*leaves) for leaves in zip(*flat)])
