"""The object graph of a checkpoint: which values it holds, under which paths.

``collect_slots`` walks the objects given to a ``Checkpoint`` and returns one
*slot* per saved value, keyed by its object path (``model/dense/kernel``).

What is saved:

- ``ms.Variable``; NumPy, CuPy and JAX arrays (typed PRNG keys as their key data);
  Python and NumPy numbers (``bool``, ``int``, ``float``) anywhere;
- Keras 3 layers, models, optimizers and metrics, Flax NNX modules, ``nnx.State`` and
  ``nnx.Optimizer`` (their variables, under the paths of ``frameworks.py``);
- dicts and other mutable mappings, lists, tuples, NamedTuples (optax states), and every
  registered JAX pytree node (``flax.struct`` dataclasses, Equinox modules, custom nodes);
- objects that follow the state protocol (below), nested checkpoints, objects with
  ``_checkpoint_children()``, and any other object through its public attributes
  (``__dict__`` or ``__slots__``; names starting with ``_`` are private and skipped).

Restores write into mutable values (variables, writeable NumPy and CuPy arrays, dict and
list items, attributes). Immutable values (JAX arrays, read-only NumPy arrays, numbers) and
immutable containers (tuples, NamedTuples, pytree nodes) are rebuilt and rebound on their
parent, so ``ckpt.opt_state`` is then the restored tree, of the same treedef. A mutable
object held at several paths is saved once, under its first path; an immutable value
(JAX array, read-only array, tuple) is saved at every path that holds it, since each
holder is rebound separately.

What is skipped, silently, because it is not state: ``None``, strings and bytes, enum
members, classes, modules and dtypes anywhere; functions, methods, partials and wrapped or
jitted functions held as an *attribute* (an activation, a loss function: code). What is refused: anything else. A function, lambda
or method given to the checkpoint or held in a container, a generator, any object with
no state the walk can see (no ``__dict__``, no ``__slots__``, not a known kind), and an
object none of whose public attributes can hold state (only strings, ``None``, code) make
``collect_slots(..., strict=True)`` (what ``save`` uses) raise one ``ValueError`` naming the
path of each such value: a checkpoint never silently lacks a value.

The state protocol::

    class Counter:
        def _serialize_to_tensors(self):          # name -> array
            return {"count": np.array(self.count)}
        def _restore_from_tensors(self, tensors):  # name -> np.ndarray
            self.count = int(tensors["count"])

Path segments are checked against ``[A-Za-z0-9_.-]+`` plus the letters, marks and digits of
any script (``café``, ``重み``: TensorFlow keeps such names as UTF-8), never ``.`` or ``..``,
both when saving and when reading a file, so a crafted file cannot address anything else.

    >>> import numpy as np
    >>> from mpistrat.checkpoint.graph import collect_slots
    >>> class Dense: pass
    >>> layer = Dense(); layer.kernel = np.zeros((2, 2)); layer.step = 3
    >>> sorted(collect_slots({"model": layer}))
    ['model/kernel', 'model/step']
"""

import collections.abc
import enum
import functools
import re
import sys
import types
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from mpistrat.checkpoint import frameworks, pytrees
from mpistrat.distribute.variables import Variable

__all__ = ["Slot", "SlotMap", "collect_slots", "required_paths", "check_segment",
           "check_path", "leaf_slot", "root_children", "in_symbolic_build",
           "initial_values_only"]

_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]+")
_NUMBERS = (bool, int, float, np.number, np.bool_)
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
         types.BuiltinMethodType, types.LambdaType, staticmethod, classmethod)


def check_segment(name: Any) -> str:
    """A valid path segment, or ``ValueError`` naming it."""
    text = str(name)
    if not (_SEGMENT.fullmatch(text) or not text.isascii() and all(
            c < "\x80" and _SEGMENT.fullmatch(c) or c >= "\x80" and
            unicodedata.category(c)[0] in "LMN" for c in text)) or text in (".", ".."):
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
    """One saved value: how to read it now and how to put a restored value back.

    ``shape``/``dtype`` (when set) are what the object holds, checked before a restore.
    """

    path: str
    kind: str                        # variable, array, bool, int, float, state
    read: Callable[[], np.ndarray]
    write: Optional[Callable[[np.ndarray], None]]
    owner: Any = field(default=None, repr=False)
    shape: Optional[tuple] = None
    dtype: Optional[np.dtype] = None
    rebind: Optional[Callable[[Any], None]] = field(default=None, repr=False)  # numbers


class SlotMap(dict):
    """Object path -> ``Slot``, plus what a restore needs besides: the immutable nodes to
    rebuild (``finish``) and the framework objects not built yet (``unbuilt``)."""

    def __init__(self):
        super().__init__()
        self.nodes: List[pytrees.Rebuild] = []
        self.unbuilt: List[Any] = []

    def finish(self) -> None:
        """Rebuild every immutable node a restore changed, deepest first, and rebind it."""
        for node in sorted(self.nodes, key=lambda n: -n.depth):
            node.rebuild()


class _Walk:
    def __init__(self, strict: bool):
        # id -> object: holding the objects keeps their ids unique while we walk (children
        # made on access, as nnx.State's nested states, would otherwise reuse freed ids)
        self.slots, self.seen, self.strict = SlotMap(), {}, strict
        self.refused: List[str] = []

    def refuse(self, path: str, obj: Any, why: str) -> None:
        self.refused.append(f"{path!r} ({type(obj).__module__}.{type(obj).__qualname__}: {why})")


def required_paths(slots) -> set:
    """The slot paths a checkpoint should hold: all but the state keys their owner declares
    optional (``_optional_tensors()``: keys added after checkpoints were saved without them,
    such as a dataset iterator's pipeline fingerprint), so an older checkpoint is complete."""
    def optional(slot) -> bool:
        declare = getattr(slot.owner, "_optional_tensors", None)
        return slot.kind == "state" and declare is not None and \
            slot.path.rsplit("/", 1)[-1] in declare()
    return {path for path, slot in slots.items() if not optional(slot)}


def collect_slots(named: Dict[str, Any], assign: Optional[Callable[[str, Any], None]] = None,
                  strict: bool = False) -> SlotMap:
    """Walk ``named`` objects into a ``SlotMap`` of object path -> ``Slot``.

    ``assign(name, value)`` rebinds a restored top-level value that cannot be restored in
    place (a number, a JAX array, a tuple); without it such values are save-only.
    ``strict``: raise ``ValueError`` naming every value that cannot be saved.
    """
    walk = _Walk(strict)
    for name in sorted(named):
        setter = None if assign is None else (lambda v, n=name: assign(n, v))
        _walk(named[name], check_segment(name), setter, walk, attribute=False, depth=0)
    if strict and walk.refused:
        raise ValueError(f"cannot save {len(walk.refused)} value(s) of this checkpoint: "
                         + "; ".join(walk.refused) + ". Save arrays, variables, numbers or "
                         "objects holding them; drop or wrap the others (the state protocol: "
                         "_serialize_to_tensors / _restore_from_tensors)")
    return walk.slots


def _is_code(obj: Any) -> bool:
    """Functions, methods, partials and wrapped functions (``jax.jit``'s, ``functools.wraps``)."""
    return isinstance(obj, _CODE) or isinstance(obj, functools.partial) or \
        callable(obj) and hasattr(obj, "__wrapped__") and not isinstance(obj, type)


def _immutable(obj: Any) -> bool:
    return isinstance(obj, tuple) or pytrees.is_jax_array(obj) or \
        isinstance(obj, np.ndarray) and not obj.flags.writeable


def _skipped(obj: Any) -> bool:
    return obj is None or obj is Ellipsis or isinstance(
        obj, (str, bytes, enum.Enum, type, types.ModuleType, np.dtype))


def _walk(obj: Any, path: str, setter, walk: _Walk, attribute: bool, depth: int) -> None:
    if _skipped(obj) or frameworks.is_static(obj):     # an IntEnum is skipped, not a number
        return
    if isinstance(obj, _NUMBERS):
        walk.slots[path] = _number_slot(path, obj, setter)
        return
    if _is_code(obj) or isinstance(obj, types.GeneratorType):
        if isinstance(obj, types.GeneratorType) or not attribute:
            walk.refuse(path, obj, "code or a generator, not state")
        return
    if not _immutable(obj):
        if id(obj) in walk.seen:   # shared objects are saved once, under their first path
            return
        walk.seen[id(obj)] = obj
    # an immutable value is saved at every path that holds it: each holder is rebound to a
    # new value on restore, so one saved copy would leave the other holders stale
    slot = _leaf_slot(obj, path, setter)
    if slot is not None:
        walk.slots[path] = slot
        return
    found = frameworks.object_children(obj)
    if found is not None:          # Keras, Flax NNX: their variables under stable names
        children, unbuilt = found
        if unbuilt:
            walk.slots.unbuilt.append(obj)
        for name, child, put in children:
            _walk(child, f"{path}/{check_path(name)}", put, walk, True, depth + 1)
        return
    if hasattr(obj, "_serialize_to_tensors") and hasattr(obj, "_restore_from_tensors"):
        for key, value in sorted(obj._serialize_to_tensors().items()):
            walk.slots[f"{path}/{check_segment(key)}"] = Slot(
                f"{path}/{key}", "state",
                lambda o=obj, k=key: np.asarray(o._serialize_to_tensors()[k]), None, obj)
    elif isinstance(obj, (dict, collections.abc.MutableMapping)):
        _check_distinct_keys(obj, path)
        for key in sorted(obj, key=str):
            _walk(obj[key], f"{path}/{check_segment(key)}",
                  lambda v, k=key: obj.__setitem__(k, v), walk, False, depth + 1)
    elif isinstance(obj, list):
        for index, item in enumerate(obj):
            _walk(item, f"{path}/{index}", lambda v, i=index: obj.__setitem__(i, v),
                  walk, False, depth + 1)
    elif hasattr(obj, "_checkpoint_children"):
        for name, child in sorted(obj._checkpoint_children().items()):
            _walk(child, f"{path}/{check_segment(name)}",
                  lambda v, n=name: setattr(obj, n, v), walk, True, depth + 1)
    elif _walk_node(obj, path, setter, walk, depth):
        return
    elif _is_plain_object(obj):
        attributes = _attributes(obj)
        if not any(_holds_state(child) for _, child in attributes):
            walk.refuse(path, obj, "no public attribute holds state (an arbitrary object)")
        for name, child in attributes:
            _walk(child, f"{path}/{check_segment(name)}",
                  lambda v, n=name: setattr(obj, n, v), walk, True, depth + 1)
    else:
        walk.refuse(path, obj, "no state the checkpoint can see (no __dict__ or __slots__)")


def _walk_node(obj: Any, path: str, setter, walk: _Walk, depth: int) -> bool:
    """A tuple or registered pytree node: children walked, the node rebuilt on restore."""
    found = pytrees.node_children(obj)
    if found is None:
        return False
    children, make = found
    node = pytrees.Rebuild([c for _, c, _ in children], make, setter, depth)
    walk.slots.nodes.append(node)
    names = [name for name, _, _ in children]
    if len(set(names)) != len(names):
        raise ValueError(f"checkpoint object {path!r}: children {names} do not have distinct "
                         f"names")
    for index, (name, child, by_attribute) in enumerate(children):
        _walk(child, f"{path}/{check_segment(name)}", node.child_setter(index), walk,
              by_attribute, depth + 1)
    return True


def _holds_state(child: Any) -> bool:
    """Whether an attribute may hold state (anything but skipped values and code)."""
    return not (_skipped(child) or _is_code(child) or frameworks.is_static(child))


def _attributes(obj: Any):
    names = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in names and hasattr(obj, name):
                names[name] = getattr(obj, name)
    return sorted((k, v) for k, v in names.items() if not k.startswith("_"))


def _is_plain_object(obj: Any) -> bool:
    has_state = hasattr(obj, "__dict__") or any(getattr(c, "__slots__", ())
                                                for c in type(obj).__mro__)
    return has_state and not isinstance(obj, (type, types.ModuleType))


def _number_slot(path, value, setter) -> Slot:
    kind = "array" if isinstance(value, np.generic) else "bool" if isinstance(value, bool) \
        else "int" if isinstance(value, int) else "float"     # subclasses as their base
    if kind == "array":   # a NumPy scalar comes back as one of the same dtype
        convert = lambda v: np.asarray(v).astype(value.dtype)[()]  # noqa: E731
    else:
        convert = {"bool": bool, "int": int, "float": float}[kind]
    return Slot(path, kind, lambda: np.asarray(value),
                None if setter is None else lambda v: setter(convert(v[()])), rebind=setter)


def _leaf_slot(obj: Any, path: str, setter) -> Optional[Slot]:
    """The slot of an array or variable, else ``None``."""
    if isinstance(obj, Variable):
        return Slot(path, "variable", obj._checkpoint_read, obj._checkpoint_restore, obj,
                    tuple(obj.shape), np.dtype(obj.dtype))
    if isinstance(obj, np.ndarray):
        if obj.flags.writeable:
            write = lambda v: _copy_into(obj, v, path)  # noqa: E731
        else:
            write = None if setter is None else \
                lambda v: setter(pytrees.readonly_rebuilt(v))
        return Slot(path, "array", lambda: obj, write, obj, obj.shape, obj.dtype)
    if pytrees.is_jax_array(obj):
        shape, dtype = pytrees.jax_shape_dtype(obj)
        write = None if setter is None else \
            lambda v: setter(pytrees.jax_rebuilt(obj, v))
        return Slot(path, "array", lambda: pytrees.jax_read(obj), write, obj, shape, dtype)
    if type(obj).__module__.startswith("cupy") and hasattr(obj, "get"):
        # a CuPy array: saved from a host copy, restored onto the GPU it lives on
        return Slot(path, "array", obj.get, lambda v: _copy_onto_device(obj, v, path), obj,
                    tuple(obj.shape), np.dtype(obj.dtype))
    parts = frameworks.variable_parts(obj)
    if parts is not None:          # a Keras or NNX variable: assigned in place
        read, write, shape, dtype = parts
        return Slot(path, "variable", read, write, obj, shape, dtype)
    return None


def leaf_slot(obj: Any, path: str) -> Optional[Slot]:
    """The slot of a variable found outside the walk (a TensorFlow restore binds objects by
    attribute, private ones included), else ``None``: only variables (ours, Keras's, NNX's),
    which restore through their own assignment; never a bare array reached through a file's
    names (an ``ms.Variable``'s ``_value``, an object's private cache)."""
    slot = _leaf_slot(obj, path, None)
    return slot if slot is not None and slot.kind == "variable" else None


def root_children(root: Any) -> Dict[str, Any]:
    """The top-level objects of a checkpoint whose root object is ``root``
    (``Checkpoint(model)``): a dict's items, a nested checkpoint's children, a Keras object's
    variables and sublayers (as under any other path), else public attributes.

        >>> import numpy as np
        >>> class Net: pass
        >>> net = Net(); net.w = np.zeros(2); net._cache = np.ones(2)
        >>> sorted(root_children(net))
        ['w']
    """
    if isinstance(root, dict):
        return dict(root)
    if hasattr(root, "_checkpoint_children"):
        return dict(root._checkpoint_children())
    keras = type(root).__module__.startswith("keras")   # (in place; NNX roots as before)
    found = frameworks.object_children(root) if keras else None
    if found is None:
        return {k: v for k, v in vars(root).items() if not k.startswith("_")}
    children: Dict[str, Any] = {}
    for name, child, _ in found[0]:        # ('momentums/0', v): nested as {'momentums': {...}}
        *parents, last = name.split("/")
        holder = children
        for part in parents:
            holder = holder.setdefault(part, {})
        holder[last] = child
    return children


def in_symbolic_build() -> bool:
    """Whether Keras is imported and runs inside a ``StatelessScope`` now."""
    if "keras" not in sys.modules:
        return False
    from mpistrat.keras.adapter import in_stateless_scope
    return in_stateless_scope()


def initial_values_only(slots, found: Dict[str, str]):
    """``(slots, found)`` for values applied while Keras builds a layer inside a symbolic run
    of its caller (a ``StatelessScope``: Keras drops what is assigned there). Only a Keras
    variable made in that run and not initialized yet can take a value, as its initial value
    (``keras.adapter.set_initial_value``); every other value waits for a later build."""
    from mpistrat.keras.adapter import set_initial_value
    kept: Dict[str, Slot] = {}
    for path in found:
        slot = slots[path]
        if slot.kind == "variable" and type(slot.owner).__module__.startswith("keras") and \
                getattr(slot.owner, "_value", 0) is None:
            kept[path] = Slot(path, slot.kind, slot.read,
                              lambda v, o=slot.owner: set_initial_value(o, v), slot.owner,
                              slot.shape, slot.dtype)
    return kept, {p: t for p, t in found.items() if p in kept}


def _check_distinct_keys(obj, path: str) -> None:
    """Keys that name the same path segment (``1`` and ``"1"``) cannot both be saved."""
    names: Dict[str, Any] = {}
    for key in obj:
        other = names.setdefault(str(key), key)
        if other is not key and other != key:
            raise ValueError(f"checkpoint object {path!r}: keys {other!r} and {key!r} both save "
                             f"as {path}/{key}; rename one of them")


def _copy_onto_device(target, value: np.ndarray, path: str) -> None:
    """Restore a CuPy array in place (same GPU, same memory), checking the shape first."""
    if target.shape != np.shape(value):
        raise ValueError(f"restoring {path!r}: the checkpoint holds shape {np.shape(value)}, the "
                         f"object has shape {target.shape}")
    import cupy  # only reached for CuPy arrays
    with cupy.cuda.Device(target.device.id):
        target[...] = cupy.asarray(np.asarray(value).astype(target.dtype, casting="same_kind"))


def _copy_into(target: np.ndarray, value: np.ndarray, path: str) -> None:
    if target.shape != value.shape:
        raise ValueError(f"restoring {path!r}: the checkpoint holds shape {value.shape}, the "
                         f"object has shape {target.shape}")
    np.copyto(target, value, casting="same_kind")
