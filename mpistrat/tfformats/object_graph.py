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

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from mpistrat.errors import DataLossError
from mpistrat.tfformats import messages

__all__ = ["GRAPH_KEY", "GraphValue", "ObjectGraph", "parse_graph", "build_graph",
           "escape_name"]

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VARIABLE_VALUE = "VARIABLE_VALUE"
MAX_NODES = 10_000_000
MAX_DEPTH = 1000                # object paths nest this deep at most (Keras: about 10)
MAX_PATH_CHARS = 1 << 28        # the characters of all first paths together


@dataclass(frozen=True)
class GraphValue:
    """One saved tensor: its node, attribute name, checkpoint key and our object path."""

    node: int
    name: str
    key: str
    path: str
    full_name: str = ""


class ObjectGraph:
    """The parsed graph; ``find(path)`` follows child names from the root."""

    def __init__(self, children: List[Dict[str, int]], attributes: List[Dict[str, tuple]],
                 slots: List[Tuple[int, int, str, int]]):
        self.children, self.attributes = children, attributes
        self.paths = _first_paths(children)
        for optimizer, original, slot_name, slot_node in slots:  # legacy optimizer slots
            if slot_node not in self.paths and optimizer in self.paths and original in self.paths:
                self.paths[slot_node] = (f"{self.paths[original]}/.OPTIMIZER_SLOT/"
                                         f"{self.paths[optimizer]}/{slot_name}").lstrip("/")
        self.values: List[GraphValue] = []
        self._by_path: Dict[str, GraphValue] = {}
        self._by_node: Dict[Tuple[int, str], GraphValue] = {}
        for node, path in sorted(self.paths.items()):
            for name, (key, full_name) in attributes[node].items():
                value_path = path if name == VARIABLE_VALUE else f"{path}/{name}".lstrip("/")
                value = GraphValue(node, name, key, value_path, full_name)
                self.values.append(value)
                self._by_path.setdefault(value_path, value)
                self._by_node[node, name] = value

    def find(self, path: str) -> Optional[GraphValue]:
        """The value our object at ``path`` restores from, or ``None``."""
        if path in self._by_path:
            return self._by_path[path]
        node, segments = 0, path.split("/")
        for index, segment in enumerate(segments):
            child = self.children[node].get(segment)
            if child is None:  # the last segment may name an attribute of the node reached
                if index == len(segments) - 1:
                    return self._by_node.get((node, segment))
                return None
            node = child
        return self._by_node.get((node, VARIABLE_VALUE))


def _first_paths(children: List[Dict[str, int]]) -> Dict[int, str]:
    """Each reachable node's first path from the root in breadth-first order."""
    paths = {0: ""}
    queue = deque([0])
    while queue:
        node = queue.popleft()
        for name, child in children[node].items():
            if child not in paths:
                paths[child] = f"{paths[node]}/{name}".lstrip("/")
                queue.append(child)
    return paths


def parse_graph(data: bytes, where: str) -> ObjectGraph:
    """The graph encoded in ``data``; ``DataLossError`` naming ``where`` if it is malformed."""
    proto = messages.parse("TrackableObjectGraph", data, where)
    count = len(proto.nodes)
    if not 0 < count <= MAX_NODES:
        raise DataLossError(f"{where}: an object graph of {count} nodes")
    children: List[Dict[str, int]] = []
    attributes: List[Dict[str, tuple]] = []
    slots = []
    for index, node in enumerate(proto.nodes):
        edges: Dict[str, int] = {}
        for ref in node.children:
            if not 0 <= ref.node_id < count:
                raise DataLossError(f"{where}: node {index} names child node {ref.node_id} "
                                    f"of a graph of {count}")
            edges.setdefault(ref.local_name, ref.node_id)
        children.append(edges)
        attributes.append({a.name: (a.checkpoint_key, a.full_name) for a in node.attributes})
        for slot in node.slot_variables:
            ids = (slot.original_variable_node_id, slot.slot_variable_node_id)
            if not all(0 <= i < count for i in ids):
                raise DataLossError(f"{where}: node {index} names slot nodes {ids} of a graph "
                                    f"of {count}")
            slots.append((index, ids[0], slot.slot_name, ids[1]))
    _check_paths(children, where)
    return ObjectGraph(children, attributes, slots)


def _check_paths(children: List[Dict[str, int]], where: str) -> None:
    """Refuse a graph whose first paths would be too deep or too long to hold (a crafted
    chain of 80,000 nodes spelled out every path: gigabytes, then a bare ``MemoryError``);
    the lengths are counted before any path is made."""
    depth, length = {0: 0}, {0: 0}
    queue, total = deque([0]), 0
    while queue:
        node = queue.popleft()
        for name, child in children[node].items():
            if child in depth:
                continue
            depth[child], length[child] = depth[node] + 1, length[node] + 1 + len(name)
            total += length[child]
            if depth[child] > MAX_DEPTH or total > MAX_PATH_CHARS:
                raise DataLossError(f"{where}: the object graph nests deeper than {MAX_DEPTH} "
                                    f"levels or its paths exceed {MAX_PATH_CHARS} characters "
                                    f"(node {child} at depth {depth[child]}): not a checkpoint "
                                    f"TensorFlow writes")
            queue.append(child)


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
