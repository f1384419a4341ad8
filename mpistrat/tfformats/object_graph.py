"""TF2's object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``): which object owns which tensor.

A TF2 checkpoint stores, beside its tensors, a ``TrackableObjectGraph``: node 0 is the
root ``tf.train.Checkpoint``; each node lists its children by local name and the tensors
it saved (``attributes``: a name such as ``VARIABLE_VALUE`` and the tensor's checkpoint
key). An object reachable by several paths (a Keras kernel is both
``model/.../dense/_kernel`` and ``optimizer/_trainable_variables/0``) is one node, so
values are found by walking child names, never by parsing keys.

Our object paths map onto it thus: a node's *path* is its first path in breadth-first order
(the one TensorFlow's own keys use); its ``VARIABLE_VALUE`` is the value at that path, and
any other attribute ``NAME`` the value at ``PATH/NAME`` (a state tensor, as ours are saved).
A graph is a file's word, so ``parse_graph`` bounds its work by the graph's size: only nodes
reachable from the root are visited, each once (cycles are allowed, as in TensorFlow); a
path deeper than ``MAX_DEPTH`` is refused at that depth, however long the chain; the lengths
of the value paths are added up as numbers before any path is spelled (at most
``path_budget(len(data))`` characters), and each path is spelled once, from its node's first
parent chain, never by concatenating its ancestors' paths; names must be UTF-8 text.
Slot variables of TF's legacy optimizers sit at
``VARIABLE/.OPTIMIZER_SLOT/OPTIMIZER/SLOT``, as in their keys::

    >>> from mpistrat.tfformats.object_graph import build_graph, parse_graph
    >>> data, keys = build_graph({"model/dense/kernel": "variable", "it/steps": "state"})
    >>> keys["model/dense/kernel"]
    'model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE'
    >>> graph = parse_graph(data, "a test")
    >>> graph.find("model/dense/kernel").key, graph.find("it/steps").key
    ('model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE', 'it/.ATTRIBUTES/steps')
"""

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from mpistrat.errors import DataLossError
from mpistrat.tfformats import messages
from mpistrat.tfformats.wire import WireError, read_varint, varint

__all__ = ["GRAPH_KEY", "GraphValue", "ObjectGraph", "parse_graph", "build_graph",
           "escape_name", "drop_attributes", "path_budget", "attribute_keys"]

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VARIABLE_VALUE = "VARIABLE_VALUE"
MAX_NODES = 1 << 22             # 4 Mi objects (a 1,000-layer Keras model has about 10,000)
MAX_GRAPH_BYTES = 1 << 28       # 256 MiB (parsed, a graph of empty nodes takes about 37 times
                                # its bytes; a real one's strings make that far less)
MAX_DEPTH = 1000                # object paths nest this deep at most (Keras: about 10)
_SLOT = "/.OPTIMIZER_SLOT/"


def path_budget(graph_bytes: int) -> int:
    """The most characters the value paths of a graph of ``graph_bytes`` may spell: 1 Mi plus
    twice its bytes (each attribute of a graph TensorFlow writes spells its path in its own
    ``checkpoint_key``, so its paths never add up to more than its bytes)::

        >>> path_budget(100) - (1 << 20)
        200
    """
    return (1 << 20) + 2 * graph_bytes


@dataclass(frozen=True, slots=True)
class GraphValue:
    """One saved tensor: its node, attribute name, checkpoint key and our object path."""

    node: int
    name: str
    key: str
    path: str
    full_name: str = ""


class ObjectGraph:
    """The parsed graph; ``find(path)`` follows child names from the root.

    ``children`` maps each reachable node that has children to ``{local name: node}``;
    ``values`` lists every saved tensor of a reachable (or slot) node, in node order.
    """

    def __init__(self, children: Dict[int, Dict[str, int]], values: List[GraphValue]):
        self.children, self.values = children, values
        self._by_path: Dict[str, GraphValue] = {}
        self._by_node: Dict[Tuple[int, str], GraphValue] = {}
        for value in values:
            self._by_path.setdefault(value.path, value)
            self._by_node[value.node, value.name] = value

    def find(self, path: str) -> Optional[GraphValue]:
        """The value our object at ``path`` restores from, or ``None``."""
        if path in self._by_path:
            return self._by_path[path]
        node, segments = 0, path.split("/")
        for index, segment in enumerate(segments):
            child = self.children.get(node, {}).get(segment)
            if child is None:  # the last segment may name an attribute of the node reached
                if index == len(segments) - 1:
                    return self._by_node.get((node, segment))
                return None
            node = child
        return self._by_node.get((node, VARIABLE_VALUE))


def _text(name: str, where: str, what: str) -> str:
    """``name`` if it is text (the pure-Python wire reader keeps invalid UTF-8 as
    surrogates, where protobuf refuses the message: both end here as a named error)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise DataLossError(f"{where}: {what} {name!r} is not UTF-8 text") from None
    return name


def _walk(nodes, count: int, where: str):
    """Breadth-first from the root, each reachable node once: ``children`` (nodes with any),
    each node's first ``(parent, local name)`` and the length of its path."""
    children: Dict[int, Dict[str, int]] = {}
    first: Dict[int, Tuple[int, str]] = {}
    depth, length = {0: 0}, {0: 0}
    queue = deque([0])
    while queue:
        node = queue.popleft()
        edges: Dict[str, int] = {}
        for ref in nodes[node].children:
            child, name = ref.node_id, _text(ref.local_name, where, f"node {node}'s child name")
            if not 0 <= child < count:
                raise DataLossError(f"{where}: node {node} names child node {child} of a graph "
                                    f"of {count}")
            if name in edges:          # (a repeated name: the first one holds)
                continue
            edges[name] = child
            if child in depth:         # reached before (a shared object, or a cycle)
                continue
            depth[child] = depth[node] + 1
            if depth[child] > MAX_DEPTH:
                raise DataLossError(f"{where}: the object graph nests deeper than {MAX_DEPTH} "
                                    f"levels: node {child} is at depth {depth[child]} (each "
                                    f"object holding the next); not a checkpoint TensorFlow "
                                    f"writes")
            first[child] = (node, name)
            length[child] = length[node] + bool(length[node] or node) + len(name)
            queue.append(child)
        if edges:
            children[node] = edges
    return children, first, length


def _spell(node: int, first: Dict[int, Tuple[int, str]]) -> str:
    names = []
    while node in first:
        node, name = first[node]
        names.append(name)
    return "/".join(reversed(names))


def parse_graph(data: bytes, where: str) -> ObjectGraph:
    """The graph encoded in ``data``; ``DataLossError`` naming ``where`` if it is malformed
    or would take more than its size bounds to hold (see the module's notes)."""
    if len(data) > MAX_GRAPH_BYTES:
        raise DataLossError(f"{where}: an object graph of {len(data)} bytes (at most "
                            f"{MAX_GRAPH_BYTES})")
    proto = messages.parse("TrackableObjectGraph", data, where)
    nodes = proto.nodes
    count = len(nodes)
    if not 0 < count <= MAX_NODES:
        raise DataLossError(f"{where}: an object graph of {count} nodes (at most {MAX_NODES})")
    children, first, length = _walk(nodes, count, where)
    slots: Dict[int, Tuple[int, int, str]] = {}   # slot node -> (original, optimizer, name)
    for optimizer in sorted(length):
        for slot in nodes[optimizer].slot_variables:
            ids = (slot.original_variable_node_id, slot.slot_variable_node_id)
            if not all(0 <= i < count for i in ids):
                raise DataLossError(f"{where}: node {optimizer} names slot nodes {ids} of a "
                                    f"graph of {count}")
            if ids[1] not in length and ids[1] not in slots and ids[0] in length:
                name = _text(slot.slot_name, where, f"node {optimizer}'s slot name")
                slots[ids[1]] = (ids[0], optimizer, name)
    for node, (original, optimizer, name) in slots.items():
        length[node] = length[original] + len(_SLOT) + length[optimizer] + 1 + len(name)
    owners = sorted(length)
    total, budget = 0, path_budget(len(data))
    for node in owners:
        for attribute in nodes[node].attributes:
            total += length[node] + (0 if attribute.name == VARIABLE_VALUE else
                                     bool(length[node]) + len(attribute.name))
        if total > budget:
            raise DataLossError(f"{where}: the object graph's value paths add up to over "
                                f"{budget} characters (node {node}): not a checkpoint "
                                f"TensorFlow writes")
    values: List[GraphValue] = []
    for node in owners:
        attributes = {a.name: a for a in nodes[node].attributes}   # (a repeated name: the last)
        if not attributes:
            continue
        if node in slots:
            original, optimizer, name = slots[node]
            path = f"{_spell(original, first)}{_SLOT}{_spell(optimizer, first)}/{name}".lstrip("/")
        else:
            path = _spell(node, first)
        for name, attribute in attributes.items():
            name = _text(name, where, f"node {node}'s attribute")
            key = _text(attribute.checkpoint_key, where, f"node {node}'s checkpoint key")
            full_name = _text(attribute.full_name, where, f"node {node}'s full name")
            value_path = path if name == VARIABLE_VALUE else f"{path}/{name}" if path else name
            values.append(GraphValue(node, name, key, value_path, full_name))
    return ObjectGraph(children, values)


def escape_name(name: str) -> str:
    """A local name as TensorFlow writes it into keys ('.' doubled, '/' as '.S')."""
    return name.replace(".", "..").replace("/", ".S")


def build_graph(kinds: Dict[str, str]) -> Tuple[bytes, Dict[str, str]]:
    """The serialized graph for our object paths, and the checkpoint key of each.

    ``kinds`` maps each path to its kind: ``state`` values become attribute ``NAME`` of the
    object at their parent path, every other kind the ``VARIABLE_VALUE`` of its own node.
    """
    nodes: List[dict] = [{"children": [], "attributes": []}]
    index: Dict[str, int] = {"": 0}

    def node_of(path: str) -> int:
        if path not in index:
            parent, _, name = path.rpartition("/")
            owner = node_of(parent)
            index[path] = len(nodes)
            nodes.append({"children": [], "attributes": []})
            nodes[owner]["children"].append({"node_id": index[path], "local_name": name})
        return index[path]

    keys: Dict[str, str] = {}
    for path in sorted(kinds):
        if kinds[path] == "state" and "/" in path:
            owner, _, name = path.rpartition("/")
        else:
            owner, name = path, VARIABLE_VALUE
        escaped = "/".join(escape_name(s) for s in owner.split("/")) if owner else ""
        key = f"{escaped}/.ATTRIBUTES/{name}".lstrip("/")
        nodes[node_of(owner)]["attributes"].append(
            {"name": name, "full_name": path, "checkpoint_key": key})
        keys[path] = key
    for node in nodes:
        node["has_checkpoint_values"] = {"value": True}
    return messages.serialize("TrackableObjectGraph", {"nodes": nodes}), keys


def _fields(data, pos: int, end: int) -> Iterable[Tuple[int, int, int, int, int]]:
    """``(number, start, payload start, payload end, end)`` of each field in
    ``data[pos:end]`` (the payload of a length-delimited field; else the value's bytes)."""
    while pos < end:
        start = pos
        tag, pos = read_varint(data, pos, end)
        wire = tag & 7
        if wire == 0:
            _, stop = read_varint(data, pos, end)
        elif wire in (1, 5):
            stop = pos + (8 if wire == 1 else 4)
        elif wire == 2:
            size, pos = read_varint(data, pos, end)
            stop = pos + size
        else:
            raise WireError(f"wire type {wire}")
        if stop > end:
            raise WireError("a field runs past the end of its message")
        yield tag >> 3, start, pos, stop, stop
        pos = stop


def _key_of(data, start: int, end: int) -> bytes:
    """The ``checkpoint_key`` (field 3) of the ``SerializedTensor`` in ``data[start:end]``."""
    key = b""
    for number, _, a, b, _ in _fields(data, start, end):
        if number == 3:
            key = bytes(data[a:b])
    return key


def drop_attributes(data: bytes, keys: Set[str], where: str) -> bytes:
    """The serialized graph ``data`` without the attributes whose ``checkpoint_key`` is one
    of ``keys`` (values left out of a conversion); every other byte as it was, so that a
    graph that loses nothing is returned unchanged::

        >>> data, keys = build_graph({"a": "variable", "b": "variable"})
        >>> smaller = drop_attributes(data, {keys["b"]}, "a test")
        >>> [v.path for v in parse_graph(smaller, "a test").values]
        ['a']
    """
    drop = {key.encode("utf-8") for key in keys}
    out = bytearray()
    try:
        for number, start, a, b, end in _fields(data, 0, len(data)):
            if number != 1:
                out += data[start:end]
                continue
            node = bytearray()
            for inner, s, c, d, e in _fields(data, a, b):
                if inner != 2 or _key_of(data, c, d) not in drop:
                    node += data[s:e]
            if len(node) == b - a:
                out += data[start:end]          # (unchanged: kept byte for byte)
            else:
                out += varint(1 << 3 | 2) + varint(len(node)) + node
    except WireError as err:
        raise DataLossError(f"{where}: the object graph is not a valid message ({err})") from None
    return bytes(out)


_ATTRIBUTES = "/.ATTRIBUTES/"


def attribute_keys(graph: "ObjectGraph", keys: Iterable[str], where: str) -> List[List[str]]:
    """The index keys of each of ``graph.values``, in order: its ``checkpoint_key`` when the
    index holds it, else the keys that extend it (a saveable that wrote several tensors: a
    lookup table's ``...-keys`` and ``...-values``, an iterator's ``ITERATOR_STATE``), only
    for keys of TensorFlow's attribute form (``.../.ATTRIBUTES/...``). A key claimed by two
    attributes is a ``DataLossError``, so the work is bounded by the index's size::

        >>> from mpistrat.tfformats.object_graph import ObjectGraph, GraphValue
        >>> graph = ObjectGraph({}, [GraphValue(1, "table", "t/.ATTRIBUTES/table", "t")])
        >>> attribute_keys(graph, ["t/.ATTRIBUTES/table-keys", "t/.ATTRIBUTES/table-values"], "f")
        [['t/.ATTRIBUTES/table-keys', 't/.ATTRIBUTES/table-values']]
    """
    ordered = sorted(keys)
    present = set(ordered)
    claimed: Dict[str, int] = {}
    found: List[List[str]] = []
    for number, value in enumerate(graph.values):
        if value.key in present:
            named = [value.key]
        elif _ATTRIBUTES in value.key and not value.key.endswith("/"):
            at, named = bisect.bisect_left(ordered, value.key), []
            while at < len(ordered) and ordered[at].startswith(value.key):
                named.append(ordered[at])
                at += 1
                if ordered[at - 1] in claimed:
                    break
        else:
            named = []
        for key in named:
            owner = claimed.setdefault(key, number)
            if owner != number:
                raise DataLossError(f"{where}: the object graph gives the value {key!r} to two "
                                    f"attributes ({graph.values[owner].path!r} and "
                                    f"{value.path!r}): not a checkpoint TensorFlow writes")
        found.append(named)
    return found
