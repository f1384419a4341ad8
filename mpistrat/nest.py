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

from typing import Any, Callable, List, Sequence

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
    leaves: List[Any] = []
    _flatten_into(structure, leaves)
    return leaves


def _flatten_into(structure: Any, leaves: List[Any]) -> None:
    if isinstance(structure, dict):
        for key in _sorted_keys(structure):
            _flatten_into(structure[key], leaves)
    elif isinstance(structure, (list, tuple)):
        for item in structure:
            if isinstance(item, (dict, list, tuple)):
                _flatten_into(item, leaves)
            else:
                leaves.append(item)
    else:
        leaves.append(structure)


def pack_sequence_as(structure: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild ``structure`` with ``leaves`` in place of its own leaves."""
    leaves = list(leaves)
    result, used = _pack(structure, leaves, 0)
    if used != len(leaves):
        raise ValueError(f"pack_sequence_as: {len(leaves) - used} leaves more than the "
                         f"structure holds")
    return result


def _pack(structure: Any, leaves: List[Any], position: int):
    """``structure`` rebuilt from ``leaves[position:]``, and the position after it."""
    if isinstance(structure, dict):
        items = []
        for key in _sorted_keys(structure):
            value, position = _pack(structure[key], leaves, position)
            items.append((key, value))
        return type(structure)(items), position
    if isinstance(structure, (list, tuple)):
        if not any(isinstance(item, (dict, list, tuple)) for item in structure):
            stop = position + len(structure)  # a flat sequence: one slice
            if stop > len(leaves):
                raise ValueError("pack_sequence_as: fewer leaves than the structure holds")
            items = leaves[position:stop]
        else:
            items = []
            for item in structure:
                value, position = _pack(item, leaves, position)
                items.append(value)
            stop = position
        if _is_namedtuple(structure):
            return type(structure)(*items), stop
        return (items if type(structure) is list else type(structure)(items)), stop
    if position >= len(leaves):
        raise ValueError("pack_sequence_as: fewer leaves than the structure holds")
    return leaves[position], position + 1


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``fn`` to the matching leaves of one or more structures."""
    if len(structures) == 1:  # the per-step cases of input pipelines, without the walk
        only = structures[0]
        if not isinstance(only, (dict, list, tuple)):
            return fn(only)
        if type(only) is tuple and not any(isinstance(i, (dict, list, tuple)) for i in only):
            return tuple(map(fn, only))
    flat = [flatten(s) for s in structures]
    if any(len(f) != len(flat[0]) for f in flat):
        raise ValueError("map_structure: the structures have different numbers of leaves")
    return pack_sequence_as(structures[0], [fn(*leaves) for leaves in zip(*flat)])
