"""Pytrees of the Orbax face: the values a save writes, the structure it records, the tree a
restore returns. Pure: no MPI, no files.

A save walks the item: dicts (``str`` or ``int`` keys), lists, tuples and ``None`` are recorded
as such; NamedTuples and other registered JAX pytree nodes (``flax.struct`` dataclasses,
Equinox modules) by their children's names. Leaves are NumPy or JAX arrays and Python or NumPy
numbers, saved at object paths as ``ms.Checkpoint`` names them (``params/dense/kernel``,
``layers/0``; a lone leaf as ``value``). The structure is plain JSON data, so a restore
without a target rebuilds the saved containers (custom nodes as dicts of their children)
and never evaluates anything; ``saved_leaves`` checks a structure read back from a file.

    >>> import numpy as np
    >>> from mpistrat.checkpoint.orbax_tree import describe, saved_tree
    >>> structure, values, kinds = describe({"w": np.arange(3.0), "layers": [1, (2.5, None)]})
    >>> sorted(values), kinds["layers/0"]
    (['layers/0', 'layers/1/0', 'w'], 'int')
    >>> saved_tree(structure, {p: np.asarray(v) for p, v in values.items()},
    ...            {p: k for p, k in kinds.items()})
    {'layers': [1, (2.5, None)], 'w': array([0., 1., 2.])}
"""

import copy as copying
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from mpistrat.checkpoint import pytrees
from mpistrat.checkpoint.args import refuse
from mpistrat.checkpoint.dtypes import to_stored
from mpistrat.checkpoint.graph import check_segment
from mpistrat.errors import DataLossError

__all__ = ["ROOT_LEAF", "describe", "saved_leaves", "saved_tree", "target_leaves",
           "check_target", "rebuild_target"]

ROOT_LEAF = "value"       # the path of an item that is a single leaf
MAX_DEPTH = 200
_NUMBER_KINDS = {bool: "b", int: "iu", float: "f"}


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _is_sds(obj: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(obj, jax.ShapeDtypeStruct)


def _is_leaf(obj: Any) -> bool:
    return isinstance(obj, (np.ndarray, np.generic, bool, int, float, str, bytes)) or \
        pytrees.is_jax_array(obj) or _is_sds(obj)


def _name(key: Any, path: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise ValueError(f"cannot checkpoint key {key!r} at {path or 'the root'}: dict keys "
                         f"must be strings or integers")
    try:
        return check_segment(key)
    except ValueError as err:
        raise ValueError(f"at {path or 'the root'}: {err}") from None


def _remake_dict(original: dict, pairs: List[Tuple[Any, Any]]) -> dict:
    if type(original) is dict:
        return dict(pairs)
    new = copying.copy(original)      # OrderedDict, defaultdict: the same kind of mapping
    new.clear()
    new.update(pairs)
    return new


def _split(obj: Any, path: str):
    """``(kind, [(name, key, child)], make(children))`` for a container, ``None`` for a leaf."""
    if obj is None:
        return "none", [], lambda children: None
    if _is_leaf(obj):
        return None
    if isinstance(obj, dict):
        pairs = sorted(((_name(k, path), k, v) for k, v in obj.items()), key=lambda p: p[0])
        names = [n for n, _, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"at {path or 'the root'}: keys {sorted(obj, key=str)} do not "
                             f"have distinct names")
        return "dict", pairs, lambda c: _remake_dict(obj, [(k, v) for (_, k, _), v in
                                                           zip(pairs, c)])
    if isinstance(obj, list):
        return "list", [(str(i), i, v) for i, v in enumerate(obj)], list
    if type(obj) is tuple:
        return "tuple", [(str(i), i, v) for i, v in enumerate(obj)], tuple
    found = pytrees.node_children(obj)
    if found is None:
        return None
    children, make = found
    named = [(_name(n, path), n, child) for n, child, _ in children]
    if len({n for n, _, _ in named}) != len(named):
        raise ValueError(f"at {path or 'the root'}: the children of a "
                         f"{type(obj).__qualname__} do not have distinct names")
    return "node", named, make


def _leaf(obj: Any, path: str, copy: bool):
    """``(value, kind, structure node)`` of a leaf that can be saved, else ``None``; an array
    of a dtype the file cannot hold is a ``TypeError`` naming it (before anything is written,
    also for an asynchronous save)."""
    found = _leaf_value(obj, path, copy)
    if found is not None and found[1] not in ("int", "float", "bool"):
        to_stored(np.empty((0,), found[0].dtype), path)
    return found


def _leaf_value(obj: Any, path: str, copy: bool):
    if pytrees.is_jax_array(obj):
        if not getattr(obj, "is_fully_addressable", True):
            refuse(f"saving {path!r}, a jax.Array sharded across processes", "each process "
                   "holds only its shards; mpistrat saves values every rank holds whole",
                   "gather it first (jax.experimental.multihost_utils.process_allgather)")
        value = pytrees.jax_read(obj)
        return (np.array(value, copy=True) if copy else value), "array:jax", {"t": "leaf"}
    if isinstance(obj, np.ndarray):
        return (np.array(obj, copy=True) if copy else obj), "array", {"t": "leaf"}
    if isinstance(obj, np.generic):
        return np.asarray(obj), "array", {"t": "leaf", "scalar": True}
    for kind in (bool, int, float):
        if isinstance(obj, kind):
            return np.asarray(obj), kind.__name__, {"t": "leaf"}
    return None


def describe(item: Any, copy: bool = False) -> Tuple[dict, Dict[str, np.ndarray], Dict[str, str]]:
    """``(structure, values, kinds)`` of a pytree to save; ``copy``: stage copies of mutable
    arrays (an async save). ``ValueError`` names every value that cannot be saved."""
    values: Dict[str, np.ndarray] = {}
    kinds: Dict[str, str] = {}
    refused: List[str] = []

    def walk(obj: Any, path: str, depth: int) -> dict:
        if depth > MAX_DEPTH:
            raise ValueError(f"the tree is nested more than {MAX_DEPTH} levels deep at {path!r}")
        split = _split(obj, path)
        if split is None:
            leaf = _leaf(obj, path or ROOT_LEAF, copy)
            if leaf is None:
                refused.append(f"{path or ROOT_LEAF!r} ({type(obj).__module__}."
                               f"{type(obj).__qualname__})")
                return {"t": "leaf"}
            values[path or ROOT_LEAF], kinds[path or ROOT_LEAF], node = leaf
            return node
        kind, children, _ = split
        if kind == "none":
            return {"t": "none"}
        if kind in ("list", "tuple"):
            return {"t": kind, "c": [walk(c, _join(path, n), depth + 1) for n, _, c in children]}
        if kind == "dict":
            return {"t": "dict", "k": [["i" if isinstance(k, int) else "s", k,
                                        walk(c, _join(path, n), depth + 1)]
                                       for n, k, c in children]}
        return {"t": "node", "n": type(obj).__qualname__,
                "k": [[n, walk(c, _join(path, n), depth + 1)] for n, _, c in children]}

    structure = walk(item, "", 0)
    if refused:
        raise ValueError(f"cannot save {len(refused)} value(s): {', '.join(refused)}; a pytree "
                         f"item holds NumPy or JAX arrays and Python or NumPy numbers")
    return structure, values, kinds


def saved_leaves(node: Any, where: str, path: str = "", depth: int = 0,
                 out: Optional[Dict[str, dict]] = None) -> Dict[str, dict]:
    """Path -> leaf node of a structure read from ``where``; ``DataLossError`` if malformed."""
    out = {} if out is None else out

    def bad(why: str):
        return DataLossError(f"{where}: the recorded tree is damaged at {path or 'the root'} "
                             f"({why})")

    if depth > MAX_DEPTH or not isinstance(node, dict):
        raise bad("too deep" if depth > MAX_DEPTH else "not a node")
    kind = node.get("t")
    if kind == "none":
        return out
    if kind == "leaf":
        if node.get("scalar", False) is not True and "scalar" in node:
            raise bad("a bad scalar flag")
        out[path or ROOT_LEAF] = node
        return out
    pairs: List[Tuple[str, Any]] = []
    if kind in ("list", "tuple") and isinstance(node.get("c"), list):
        pairs = [(str(i), child) for i, child in enumerate(node["c"])]
    elif kind == "dict" and isinstance(node.get("k"), list):
        for entry in node["k"]:
            if not (isinstance(entry, list) and len(entry) == 3 and
                    (entry[0], type(entry[1])) in (("s", str), ("i", int))):
                raise bad("a bad dict entry")
            pairs.append((entry[1], entry[2]))
    elif kind == "node" and isinstance(node.get("k"), list) and isinstance(node.get("n"), str):
        for entry in node["k"]:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise bad("a bad node entry")
            pairs.append((entry[0], entry[1]))
    else:
        raise bad(f"unknown node {str(kind)[:40]!r}")
    names = set()
    for name, child in pairs:
        try:
            names.add(check_segment(name))
        except ValueError as err:
            raise bad(str(err)) from None
        saved_leaves(child, where, _join(path, str(name)), depth + 1, out)
    if len(names) != len(pairs):
        raise bad("names that repeat")
    return out


def _as_saved(value: np.ndarray, kind: str, node: dict) -> Any:
    if kind in ("int", "float", "bool"):
        return {"int": int, "float": float, "bool": bool}[kind](value[()])
    return value[()] if node.get("scalar") else value


def saved_tree(structure: dict, values: Dict[str, np.ndarray], kinds: Dict[str, str],
               path: str = "") -> Any:
    """The tree as saved, from a checked structure: NumPy arrays (JAX arrays too), NumPy
    scalars, Python numbers; custom nodes as dicts of their children."""
    kind = structure["t"]
    if kind == "none":
        return None
    if kind == "leaf":
        return _as_saved(values[path or ROOT_LEAF], kinds[path or ROOT_LEAF], structure)
    if kind in ("list", "tuple"):
        items = [saved_tree(c, values, kinds, _join(path, str(i)))
                 for i, c in enumerate(structure["c"])]
        return items if kind == "list" else tuple(items)
    pairs = structure["k"] if kind == "node" else [(k, c) for _, k, c in structure["k"]]
    return {k: saved_tree(c, values, kinds, _join(path, str(k))) for k, c in pairs}


def _visit(obj: Any, path: str, on_leaf: Callable[[str, Any], Any], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"the target is nested more than {MAX_DEPTH} levels deep at {path!r}")
    split = _split(obj, path)
    if split is None:
        return on_leaf(path or ROOT_LEAF, obj)
    _, children, make = split
    return make([_visit(c, _join(path, n), on_leaf, depth + 1) for n, _, c in children])


def target_leaves(target: Any) -> Dict[str, Any]:
    """Path -> leaf of a restore target (the paths a save of that tree would write)."""
    leaves: Dict[str, Any] = {}
    _visit(target, "", leaves.__setitem__)
    return leaves


def _wanted(leaf: Any, path: str) -> Tuple[tuple, np.dtype]:
    if pytrees.is_jax_array(leaf):
        return pytrees.jax_shape_dtype(leaf)
    if _is_sds(leaf):
        jax = sys.modules["jax"]
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            refuse(f"a ShapeDtypeStruct of PRNG keys at {path!r}", "its key data shape is "
                   "not known", "pass a key array (jax.random.key(0)) as the target")
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return tuple(np.shape(leaf)), leaf.dtype
    raise ValueError(f"cannot restore into {path!r}: a target leaf must be an array, a "
                     f"jax.ShapeDtypeStruct or a number, not {type(leaf).__qualname__}")


def check_target(leaf: Any, entry: Any, path: str, source: str) -> None:
    """The saved value ``entry`` (shape, dtype) fits the target leaf, else ``ValueError``."""
    held = f"{entry.dtype}{list(entry.shape)}"
    for number, letters in _NUMBER_KINDS.items():
        if isinstance(leaf, number) and not isinstance(leaf, np.generic):
            if tuple(entry.shape) != () or entry.dtype.kind not in letters:
                raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds "
                                 f"{held}, the target is a Python {number.__name__}")
            return
    shape, dtype = _wanted(leaf, path)
    integers = entry.dtype.kind in "iu" and np.dtype(dtype).kind in "iu"  # (checked when read)
    if tuple(entry.shape) != tuple(shape) or entry.dtype != dtype and not integers:
        raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds {held}, "
                         f"the target is {dtype}{list(shape)}")


def _fitted(value: np.ndarray, dtype: np.dtype, path: str) -> np.ndarray:
    """An integer value in the target's integer dtype (a step counter saved as a Python int,
    restored into a JAX int32), when every value fits; else ``ValueError``."""
    if value.dtype == dtype or value.size == 0:
        return value.astype(dtype, copy=False)
    info = np.iinfo(dtype)
    if int(value.min()) < info.min or int(value.max()) > info.max:
        raise ValueError(f"cannot restore {path!r}: the checkpoint holds {value.dtype} values "
                         f"from {value.min()} to {value.max()}, which do not fit the target's "
                         f"{dtype}")
    return value.astype(dtype)


def _restored(leaf: Any, value: np.ndarray, path: str) -> Any:
    if not isinstance(leaf, (bool, int, float)) or isinstance(leaf, np.generic):
        value = _fitted(value, _wanted(leaf, path)[1], path) if value.dtype.kind in "iu" \
            else value
    if pytrees.is_jax_array(leaf):
        return pytrees.jax_rebuilt(leaf, value)     # its sharding; a key array for keys
    if _is_sds(leaf):
        sharding = getattr(leaf, "sharding", None)
        return value if sharding is None else sys.modules["jax"].device_put(value, sharding)
    if isinstance(leaf, np.generic):
        return value[()]
    if isinstance(leaf, np.ndarray):
        return value
    return type(leaf)(value[()])                     # a Python number of the target's type


def rebuild_target(target: Any, values: Dict[str, np.ndarray]) -> Any:
    """A new tree of the target's structure and types holding ``values`` (checked before)."""
    return _visit(target, "", lambda path, leaf: _restored(leaf, values[path], path))
