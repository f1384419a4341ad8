"""A cluster to simulate: nodes of ranks, in-node links, NICs and a network, as plain data.

``ClusterSpec`` holds every parameter (SI units: bytes per second, seconds);
``Platform`` derives the links and the route between any two ranks from it,
without SimGrid, so routes and bytes per link are tested and counted in pure
Python and the player (``player.py``) only builds what it is given.

* In a node: every rank has a port to the node's switch (``in-up/R``,
  ``in-down/R``; NVSwitch-like, or a process's shared-memory copies).
* Between nodes: the node's NIC (``nic-up/N``, ``nic-down/N``) and the network:
  ``flat`` (one non-blocking switch), ``fat-tree`` (leaves of ``leaf_nodes``
  nodes whose uplinks carry ``leaf_nodes x NIC / oversubscription``; a
  non-blocking spine) or ``dragonfly`` (groups of ``group_nodes`` nodes, an
  all-to-all of global links between groups, one per pair, minimal routing).
* ``shared_cores`` > 0 puts every rank on one machine of that many cores
  (our namespace cluster): each transfer also costs both ends CPU time
  (``*_cpu_per_byte``) and every reduction runs there.

    >>> p = Platform(ClusterSpec(node_sizes=(2, 2), network="fat-tree", leaf_nodes=1))
    >>> p.route(0, 1)
    ('in-up/0', 'in-down/1')
    >>> p.route(1, 2)
    ('nic-up/0', 'leaf/0', 'leaf-up/0', 'spine', 'leaf-down/1', 'leaf/1', 'nic-down/1')
"""

from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, Tuple

__all__ = ["ClusterSpec", "Link", "Platform", "NETWORKS", "link_bytes"]

NETWORKS = ("flat", "fat-tree", "dragonfly")


@dataclass(frozen=True)
class Link:
    """One direction of a link: ``bandwidth`` bytes/s shared fairly by its flows, or a
    ``fatpipe`` (each flow gets the whole bandwidth: a switch's latency)."""

    name: str
    bandwidth: float
    latency: float
    fatpipe: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    """Everything the simulation needs to know about a cluster (see the module docstring)."""

    node_sizes: Tuple[int, ...]
    network: str = "flat"
    nic_bandwidth: float = 25e9          # bytes/s per direction
    nic_latency: float = 1e-6            # s, end to end through one switch, both NICs
    intra_bandwidth: float = 150e9       # bytes/s per rank and direction inside a node
    intra_latency: float = 1e-6
    switch_latency: float = 0.0          # s per switch crossed
    oversubscription: float = 1.0        # fat-tree: leaf downlink / uplink capacity
    leaf_nodes: int = 16                 # fat-tree: nodes per leaf switch
    group_nodes: int = 16                # dragonfly: nodes per group
    global_bandwidth: float = 25e9       # dragonfly: one global link, per direction
    combine_rate: float = 100e9          # bytes a rank reduces per second (one core / GPU)
    overhead: Tuple[Tuple[str, float], ...] = (("python", 0.0), ("mpi", 0.0))
    shared_cores: int = 0                # > 0: all ranks on one machine of this many cores
    net_cpu_per_byte: float = 0.0        # shared machine: CPU s per byte, each end, across nodes
    intra_cpu_per_byte: float = 0.0      # shared machine: CPU s per byte, each end, in a node
    label: str = field(default="", compare=False)

    def __post_init__(self):
        problems = []
        if not self.node_sizes or any(int(s) != s or s < 1 for s in self.node_sizes):
            problems.append(f"node sizes must be whole numbers >= 1, got {self.node_sizes!r}")
        if self.network not in NETWORKS:
            problems.append(f"network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        for name in ("nic_bandwidth", "intra_bandwidth", "global_bandwidth", "combine_rate",
                     "oversubscription"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
                problems.append(f"{name} must be a positive finite number, got {value!r}")
        for name in ("nic_latency", "intra_latency", "switch_latency", "net_cpu_per_byte",
                     "intra_cpu_per_byte"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                problems.append(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("leaf_nodes", "group_nodes"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                problems.append(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if self.shared_cores < 0:
            problems.append(f"shared_cores must be >= 0, got {self.shared_cores!r}")
        if any(o < 0 for _, o in self.overhead):
            problems.append(f"overheads must be >= 0, got {self.overhead!r}")
        if problems:
            raise ValueError("invalid cluster: " + "; ".join(problems))

    @property
    def ranks(self) -> int:
        return sum(self.node_sizes)

    def with_nodes(self, node_sizes: Tuple[int, ...]) -> "ClusterSpec":
        """The same cluster with other nodes (the first ``len(node_sizes)`` of the network)."""
        return replace(self, node_sizes=tuple(node_sizes))


class Platform:
    """Links and routes of a ``ClusterSpec``; ranks are numbered node by node."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.node_of: Tuple[int, ...] = tuple(n for n, size in enumerate(spec.node_sizes)
                                              for _ in range(size))
        self.overhead: Dict[str, float] = dict(spec.overhead)
        self._links: Dict[str, Link] = {}
        self._routes: Dict[Tuple[int, int], Tuple[str, ...]] = {}
        self._info: Dict[Tuple[int, int], tuple] = {}

    @property
    def ranks(self) -> int:
        return len(self.node_of)

    def link(self, name: str) -> Link:
        """The link called ``name`` (made on first use)."""
        found = self._links.get(name)
        if found is None:
            found = self._links[name] = self._make_link(name)
        return found

    def _make_link(self, name: str) -> Link:
        s = self.spec
        kind = name.split("/")[0]
        if kind in ("in-up", "in-down"):
            return Link(name, s.intra_bandwidth, s.intra_latency / 2)
        if kind in ("nic-up", "nic-down"):
            return Link(name, s.nic_bandwidth, s.nic_latency / 2)
        if kind in ("leaf-up", "leaf-down"):
            return Link(name, s.leaf_nodes * s.nic_bandwidth / s.oversubscription, 0.0)
        if kind == "global":
            return Link(name, s.global_bandwidth, s.switch_latency)
        # switches: leaf/L, spine, group/G, switch
        return Link(name, 1e15, s.switch_latency, fatpipe=True)

    def route(self, src: int, dst: int) -> Tuple[str, ...]:
        """The links a message from rank ``src`` to rank ``dst`` crosses, in order."""
        key = (src, dst)
        found = self._routes.get(key)
        if found is None:
            found = self._routes[key] = self._make_route(src, dst)
            for name in found:
                self.link(name)
        return found

    def _make_route(self, src: int, dst: int) -> Tuple[str, ...]:
        if src == dst:
            raise ValueError(f"rank {src} sends to itself: no route")
        a, b = self.node_of[src], self.node_of[dst]
        if a == b:
            return (f"in-up/{src}", f"in-down/{dst}")
        s = self.spec
        if s.network == "flat":
            middle: Tuple[str, ...] = ("switch",)
        elif s.network == "fat-tree":
            la, lb = a // s.leaf_nodes, b // s.leaf_nodes
            middle = (f"leaf/{la}",) if la == lb else \
                (f"leaf/{la}", f"leaf-up/{la}", "spine", f"leaf-down/{lb}", f"leaf/{lb}")
        else:
            ga, gb = a // s.group_nodes, b // s.group_nodes
            middle = (f"group/{ga}",) if ga == gb else \
                (f"group/{ga}", f"global/{ga}-{gb}", f"group/{gb}")
        return (f"nic-up/{a}",) + middle + (f"nic-down/{b}",)

    def route_info(self, src: int, dst: int) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """``(links that can be shared, link classes)`` of a route (cached)."""
        key = (src, dst)
        found = self._info.get(key)
        if found is None:
            route = self.route(src, dst)
            found = self._info[key] = (tuple(n for n in route if not self.link(n).fatpipe),
                                       tuple(n.split("/")[0] for n in route))
        return found

    def crosses_nodes(self, src: int, dst: int) -> bool:
        return self.node_of[src] != self.node_of[dst]

    def cpu_per_byte(self, src: int, dst: int) -> float:
        """Shared machine only: CPU seconds per byte that each end spends on a transfer."""
        s = self.spec
        return s.net_cpu_per_byte if self.crosses_nodes(src, dst) else s.intra_cpu_per_byte

    def links(self) -> Iterable[Link]:
        return self._links.values()


def link_bytes(platform: Platform, rounds) -> Dict[str, int]:
    """Bytes that cross each link over ``rounds`` (switch fat pipes left out)."""
    totals: Dict[str, int] = {}
    for r in rounds:
        for src, dst, nbytes in r.transfers:
            for name in platform.route(src, dst):
                if not platform.link(name).fatpipe:
                    totals[name] = totals.get(name, 0) + nbytes
    return totals
