"""TensorFlow's matching rule for a restore: objects bound to the graph by attribute structure.

TensorFlow restores a checkpoint by walking its object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``)
from the root in breadth-first order and, for each child name, taking the object the live
program holds under that name (an attribute, a list index, a dict key): a node is bound to the
first object reached, and its values go to that object. Automatic layer names
(``dense_1``) play no part, so a model whose names shifted still gets each layer's own values.

Keras 3 keeps the same attributes on every backend (``_functional``, ``_operations``,
``_kernel``, ``_momentums``, ``inner_optimizer``), so a Keras model rebuilt on JAX is bound to
a TensorFlow Keras checkpoint exactly as TensorFlow binds it. ``bind`` reads only what
an object holds (``__dict__``, ``__slots__``, list items, mapping items and a nested
``Checkpoint``'s children), never a property, so a file's names run no code::

    >>> import numpy as np
    >>> from mpistrat.tfformats.object_graph import build_graph, parse_graph
    >>> graph = parse_graph(build_graph({"net/l1/_kernel": "variable"})[0], "a test")
    >>> class Layer: pass
    >>> layer = Layer(); layer._kernel = np.zeros(2)
    >>> bound = bind(graph, {"net": {"l1": layer}})
    >>> bound.nodes[graph.find("net/l1/_kernel").node] is layer._kernel
    True
"""

import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from mpistrat.checkpoint.frameworks import install_build_hook
from mpistrat.checkpoint.graph import leaf_slot
from mpistrat.errors import InvalidArgumentError
from mpistrat.tfformats.object_graph import VARIABLE_VALUE, GraphValue, ObjectGraph

__all__ = ["Bindings", "edges", "bind", "structural_matches", "hook_unbuilt",
           "refuse_saved_model", "match_converted"]

_INDEX = re.compile(r"[0-9]{1,9}")


@dataclass
class Bindings:
    """``nodes``: graph node -> the live object bound to it (the first reached, as in
    TensorFlow), through ``parents`` (node -> its parent node and child name);
    ``conflicts``: a node reached again at another object of ours ``(node, first object,
    other object, (parent, name) of the other)``."""

    nodes: Dict[int, Any] = field(default_factory=dict)
    parents: Dict[int, Tuple[int, str]] = field(default_factory=dict)
    conflicts: List[Tuple[int, Any, Any, Tuple[int, str]]] = field(default_factory=list)

    def path(self, node: int, last: Optional[Tuple[int, str]] = None) -> str:
        """The path at which ``node`` was bound (or reached through ``last``), spelled now."""
        names = []
        step = last if last is not None else self.parents.get(node)
        while step is not None:
            node, name = step
            names.append(name)
            step = self.parents.get(node)
        return "/".join(reversed(names))


def _lookup(obj: Any, name: str, cache: Dict[int, Dict[str, Any]]) -> Any:
    """The child ``obj`` holds under TensorFlow's local ``name``, or ``None``."""
    if isinstance(obj, (list, tuple)):
        return obj[int(name)] if _INDEX.fullmatch(name) and int(name) < len(obj) else None
    if isinstance(obj, Mapping):
        if name in obj:
            return obj[name]
        keys = cache.get(id(obj))
        if keys is None:    # keys that are not strings (``1``) spelled as TensorFlow does
            keys = cache[id(obj)] = {str(k): k for k in obj if not isinstance(k, str)}
        return obj[keys[name]] if name in keys else None
    if hasattr(obj, "_checkpoint_children"):   # a nested Checkpoint, as graph.py walks it
        children = cache.get(id(obj))
        if children is None:
            children = cache[id(obj)] = dict(obj._checkpoint_children())
        if name in children:
            return children[name]
    held = getattr(obj, "__dict__", None)
    if isinstance(held, dict) and name in held:
        return held[name]
    for cls in type(obj).__mro__:
        names = getattr(cls, "__slots__", ())
        if name in ((names,) if isinstance(names, str) else names):
            return getattr(obj, name, None)
    return None


def edges(graph: ObjectGraph, node: int) -> Dict[str, int]:
    """``{local name: child node}`` of ``node`` (none for a node without children)."""
    children = graph.children
    if isinstance(children, dict):
        return children.get(node, {})
    return children[node] if 0 <= node < len(children) else {}


def bind(graph: ObjectGraph, named: Dict[str, Any], root: Any = None) -> Bindings:
    """Bind the graph's nodes to our objects: node 0 is the checkpoint, whose children are
    ``named`` (what ``Checkpoint`` tracks) and, with a root object, what the root holds."""
    bound = Bindings()
    cache: Dict[int, Dict[str, Any]] = {}
    queue = deque([0])
    while queue:
        node = queue.popleft()
        for name, child in edges(graph, node).items():
            if node == 0:
                obj = named.get(name) if name in named else \
                    None if root is None else _lookup(root, name, cache)
            else:
                obj = _lookup(bound.nodes[node], name, cache)
            if obj is None or child == 0:
                continue
            first = bound.nodes.get(child)
            if first is None:
                bound.nodes[child], bound.parents[child] = obj, (node, name)
                queue.append(child)
            elif first is not obj:
                bound.conflicts.append((child, first, obj, (node, name)))
    return bound


def structural_matches(graph: ObjectGraph, bound: Bindings, slots, present: Set[str],
                       make_slot) -> Tuple[Dict[str, str], Dict[str, Any], List[str]]:
    """Our slot path -> the checkpoint path of its value, for each of our objects bound to a
    node holding a value that ``present`` (the paths the index holds) includes.

    A bound variable our walk did not reach (a private attribute, a Keras model's
    ``optimizer`` under a model given as the root) gets a slot from ``make_slot(obj, path)``
    under the checkpoint's path, returned in the second dict. The third lists, in words,
    where two of our objects contend for one value or one object for two values (the first,
    in TensorFlow's order, is taken)."""
    owners: Dict[int, List[str]] = {}
    states: Dict[Tuple[int, str], str] = {}
    for path, slot in slots.items():
        if slot.owner is None:
            continue
        if slot.kind == "state":
            states[id(slot.owner), path.rsplit("/", 1)[-1]] = path
        elif slot.kind in ("variable", "array"):
            owners.setdefault(id(slot.owner), []).append(path)
    found: Dict[str, str] = {}
    extra: Dict[str, Any] = {}
    notes: List[str] = []
    for value in graph.values:
        obj = bound.nodes.get(value.node)
        if obj is None or value.path not in present:
            continue
        if value.name != VARIABLE_VALUE:
            ours: Optional[str] = states.get((id(obj), value.name))
        else:
            paths = owners.get(id(obj), [])
            ours = paths[0] if len(paths) == 1 else None   # (one immutable value at several
            if not paths and value.path not in slots:        # paths: matched by path)
                slot = make_slot(obj, value.path)
                if slot is not None and slot.write is not None:
                    extra[value.path] = slot
                    ours = value.path
        if ours is None:
            continue
        if ours in found:
            notes.append(f"our {ours!r} is reached at the checkpoint's {found[ours]!r} and "
                         f"{value.path!r}; it takes the first")
            continue
        found[ours] = value.path
    contended = [c for c in bound.conflicts if not (_plain(c[1]) or _plain(c[2]))]
    for node, first, other, step in contended[:5]:    # (equal numbers are no contention)
        notes.append(f"the checkpoint's {bound.path(node)!r} is reached at two different "
                     f"objects of ours (also at {bound.path(node, step)!r}); the first, in "
                     f"TensorFlow's order, takes its values")
    return found, extra, notes


def _plain(obj: Any) -> bool:
    return isinstance(obj, (bool, int, float, complex, str, bytes, np.generic))


def hook_unbuilt(checkpoint, graph: Optional[ObjectGraph], named: Dict[str, Any]) -> None:
    """A Keras layer or optimizer bound to the graph but not built yet restores the values
    pending for it as soon as Keras builds it (TensorFlow restores on creation), also when
    our walk does not reach it (a model's ``optimizer`` under a model given as the root)."""
    if graph is None:
        return
    built = checkpoint._when_built()
    seen: Set[int] = set()
    for obj in bind(graph, named, checkpoint._root).nodes.values():
        if id(obj) in seen or not type(obj).__module__.startswith("keras"):
            continue
        seen.add(id(obj))
        if getattr(obj, "built", True) is False and callable(getattr(obj, "build", None)):
            install_build_hook(obj, id(checkpoint), built)


def refuse_saved_model(values, found: Dict[str, str], prefix: str) -> None:
    """The variables of a SavedModel (``model.export``, ``tf.saved_model.save``) hold their
    values in the export's own lists (``variables/N``), not under a model's attributes, so
    ``tf.train.Checkpoint(model=model)`` restores nothing from them: when nothing of ours
    met a value, ``InvalidArgumentError`` says how to restore them as TensorFlow can."""
    graph = values.graph
    if graph is None or set(found) - {"save_counter"}:
        return
    top = edges(graph, 0)     # (the graph alone decides: every rank holds the same)
    if not {"variables", "signatures"} <= set(top):
        return
    lists = sorted(n for n in top if n.endswith("variables"))
    count = len(edges(graph, top["variables"])) if "variables" in top else 0
    raise InvalidArgumentError(
        f"{prefix} holds the variables of a SavedModel (model.export or tf.saved_model.save), "
        f"not a training checkpoint: its object graph keeps them in the export's lists "
        f"{lists} ({count} in 'variables'), not under a model's attributes, so nothing of "
        f"this Checkpoint can be matched (TensorFlow's tf.train.Checkpoint(model=model) "
        f"restores nothing from it either). Restore them in the model's variable order, as "
        f"tf.train.Checkpoint(variables=model.variables) does: "
        f"ms.Checkpoint(variables=model.variables).restore(prefix), with the model built "
        f"exactly as it was exported")


class _PathTree:
    """The object graph a file of paths spells (a file converted from TensorFlow holds
    each value at TensorFlow's first path): one node per path prefix."""

    def __init__(self, paths):
        self.children: Dict[int, Dict[str, int]] = {}
        self.values: List[GraphValue] = []
        nodes = {"": 0}
        for path in sorted(paths):
            parent = ""
            for segment in path.split("/"):
                here = f"{parent}/{segment}" if parent else segment
                if here not in nodes:
                    nodes[here] = len(nodes)
                    self.children.setdefault(nodes[parent], {})[segment] = nodes[here]
                parent = here
            self.values.append(GraphValue(nodes[path], VARIABLE_VALUE, path, path))


def match_converted(paths, slots, named: Dict[str, Any], root: Any = None) -> Dict[str, str]:
    """Our slot path -> the file's path, for a file converted from TensorFlow: TensorFlow's
    rule on the tree its paths spell (variables bound outside our walk get slots, added to
    ``slots``), then the same path for what that does not reach, unless taken."""
    tree = _PathTree(paths)
    found, extra, _ = structural_matches(tree, bind(tree, named, root), slots, set(paths),
                                         leaf_slot)
    slots.update(extra)
    claimed, held = set(found.values()), set(paths)
    for path in slots:
        if path not in found and path in held and path not in claimed:
            found[path] = path
    return found
