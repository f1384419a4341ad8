"""The object graph of a checkpoint: which values it holds, under which paths.

``collect_slots`` walks the objects given to a ``Checkpoint`` and returns one
*slot* per saved value, keyed by its object path (``model/dense/kernel``).
It walks into ``ms.Variable``, NumPy arrays, dicts, lists and tuples, Python
and NumPy numbers held in containers or attributes, nested checkpoints, any
object with public attributes holding such values, and objects that follow
the state protocol::

    class Counter:
        def _serialize_to_tensors(self):          # name -> array
            return {"count": np.array(self.count)}
        def _restore_from_tensors(self, tensors):  # name -> np.ndarray
            self.count = int(tensors["count"])

Path segments are checked against ``[A-Za-z0-9_.-]+`` both when saving and
when reading a file, so a crafted file cannot address anything else.

    >>> import numpy as np
    >>> from mpistrat.checkpoint.graph import collect_slots
    >>> class Dense: pass
    >>> layer = Dense(); layer.kernel = np.zeros((2, 2)); layer.step = 3
    >>> sorted(collect_slots({"model": layer}))
    ['model/kernel', 'model/step']
"""

import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import numpy as np

from mpistrat.distribute.variables import Variable

__all__ = ["Slot", "collect_slots", "check_segment", "check_path"]

_SEGMENT = re.compile(r"^[A-Za-z0-9_.\-]+$")
_NUMBER_KINDS = {bool: "bool", int: "int", float: "float"}


def check_segment(name: Any) -> str:
    """A valid path segment, or ``ValueError`` naming it."""
    text = str(name)
    if not _SEGMENT.match(text) or text in (".", ".."):
        raise ValueError(f"checkpoint object name {text!r} is not allowed: use letters, digits, "
                         f"'_', '.' and '-' only")
    return text


def check_path(path: str) -> str:
    """A valid object path (segments joined by '/'), or ``ValueError``."""
    for segment in path.split("/"):
        check_segment(segment)
    return path


@dataclass
class Slot:
    """One saved value: how to read it now and how to put a restored value back."""

    path: str
    kind: str                        # variable, array, bool, int, float, state
    read: Callable[[], np.ndarray]
    write: Optional[Callable[[np.ndarray], None]]
    owner: Any = field(default=None, repr=False)


def _number_slot(path, value, setter) -> Slot:
    kind = _NUMBER_KINDS.get(type(value), "array")
    convert = {"bool": bool, "int": int, "float": float}.get(kind, lambda v: v)
    return Slot(path, kind, lambda: np.asarray(value),
                None if setter is None else lambda v: setter(convert(v[()])))


def _is_plain_object(obj: Any) -> bool:
    return hasattr(obj, "__dict__") and not isinstance(
        obj, (type, types.ModuleType, types.FunctionType, types.MethodType))


def collect_slots(named: Dict[str, Any],
                  assign: Optional[Callable[[str, Any], None]] = None) -> Dict[str, Slot]:
    """Walk ``named`` objects into a dict of object path -> ``Slot``.

    ``assign(name, value)`` puts a restored top-level number back (numbers are
    immutable, so their holder must be told); without it they are save-only.
    """
    slots: Dict[str, Slot] = {}
    seen: set = set()
    for name in sorted(named):
        setter = None if assign is None else (lambda v, n=name: assign(n, v))
        _walk(named[name], check_segment(name), setter, slots, seen)
    return slots


def _walk(obj: Any, path: str, setter, slots: Dict[str, Slot], seen: set) -> None:
    if isinstance(obj, (bool, int, float, np.number, np.bool_)):
        slots[path] = _number_slot(path, obj, setter)
        return
    if isinstance(obj, (str, bytes, type(None))) or callable(obj) and not _is_plain_object(obj):
        return
    if id(obj) in seen:       # shared objects are saved once, under their first path
        return
    seen.add(id(obj))
    if isinstance(obj, Variable):
        slots[path] = Slot(path, "variable", obj._checkpoint_read, obj._checkpoint_restore, obj)
    elif isinstance(obj, np.ndarray):
        slots[path] = Slot(path, "array", lambda: obj, lambda v: _copy_into(obj, v, path), obj)
    elif hasattr(obj, "_serialize_to_tensors") and hasattr(obj, "_restore_from_tensors"):
        for key, value in sorted(obj._serialize_to_tensors().items()):
            slots[f"{path}/{check_segment(key)}"] = Slot(
                f"{path}/{key}", "state",
                lambda o=obj, k=key: np.asarray(o._serialize_to_tensors()[k]), None, obj)
    elif isinstance(obj, dict):
        _check_distinct_keys(obj, path)
        for key in sorted(obj, key=str):
            _walk(obj[key], f"{path}/{check_segment(key)}",
                  lambda v, k=key: obj.__setitem__(k, v), slots, seen)
    elif isinstance(obj, (list, tuple)):
        mutable = isinstance(obj, list)
        for index, item in enumerate(obj):
            _walk(item, f"{path}/{index}",
                  (lambda v, i=index: obj.__setitem__(i, v)) if mutable else None, slots, seen)
    elif hasattr(obj, "_checkpoint_children"):
        for name, child in sorted(obj._checkpoint_children().items()):
            _walk(child, f"{path}/{check_segment(name)}",
                  lambda v, n=name: setattr(obj, n, v), slots, seen)
    elif _is_plain_object(obj):
        for name, child in sorted(vars(obj).items()):
            if not name.startswith("_"):
                _walk(child, f"{path}/{check_segment(name)}",
                      lambda v, n=name: setattr(obj, n, v), slots, seen)


def _check_distinct_keys(obj: dict, path: str) -> None:
    """Keys that name the same path segment (``1`` and ``"1"``) cannot both be saved."""
    names: Dict[str, Any] = {}
    for key in obj:
        other = names.setdefault(str(key), key)
        if other is not key and other != key:
            raise ValueError(f"checkpoint object {path!r}: keys {other!r} and {key!r} both save "
                             f"as {path}/{key}; rename one of them")


def _copy_into(target: np.ndarray, value: np.ndarray, path: str) -> None:
    if target.shape != value.shape:
        raise ValueError(f"restoring {path!r}: the checkpoint holds shape {value.shape}, the "
                         f"object has shape {target.shape}")
    np.copyto(target, value, casting="same_kind")
