"""Playing rounds on SimGrid: the platform of a ``ClusterSpec`` and one driver actor.

SimGrid (Debian's ``python3-simgrid``, 3.32) is imported lazily, only here and
only in a child process: its engine is a one-per-process singleton, so every
``simulate`` call forks a child that builds the platform, plays the jobs and
sends the times back. Nothing of SimGrid is imported when ``mpistrat`` is.

The platform, built with SimGrid's zones: every node a full zone of its ranks
(a link pair ``in-up``/``in-down`` per rank, a gateway behind a zero-cost
port), nodes as elements of star zones behind their NIC (a split-duplex
link), grouped into fat-tree leaves (a star of leaves behind their uplinks)
or dragonfly groups (a full zone of groups joined by one global link per
pair); a flat network is one star of nodes. SimGrid's CM02 model: a message
takes the sum of its links' latencies plus its bytes over its max-min fair
share of every link (no TCP window, no cross traffic), so a lone message of
``m`` bytes on a link takes exactly ``latency + m / bandwidth``.

A round (``rounds.py``) is played as: all its messages start together (on a
shared machine, each also costs CPU time on both ends, ``Exec`` on a host of
``shared_cores`` cores); when all are done, every reduction runs (on the
rank's own host, or on the shared machine); then every rank that took part
spends the round's software overhead (on its own core, or on the shared machine). Rounds that are certain to take equal time (same key; for
rounds where no link carries two messages, same link classes and sizes) are
played once and then skipped over by advancing the clock by their duration.

    >>> simgrid_missing() in (None,) or isinstance(simgrid_missing(), str)
    True
"""

import os
import pickle
import sys
import traceback
from importlib.machinery import PathFinder
from typing import Callable, Dict, List, Optional, Sequence

from mpistrat.simulate.platform import Platform, link_bytes
from mpistrat.simulate.rounds import Round

__all__ = ["simgrid_missing", "play", "run_in_child", "traffic_by_class", "SIMGRID_PATH"]

SIMGRID_PATH = "/usr/lib/python3/dist-packages"
_GIGA = 1e9  # hosts compute 1e9 "flops" per second: an Exec of t*1e9 flops takes t seconds


def simgrid_missing() -> Optional[str]:
    """Why SimGrid cannot be used here, or ``None`` when it can (nothing is imported)."""
    if "simgrid" in sys.modules:
        return None
    if PathFinder.find_spec("simgrid", [SIMGRID_PATH] + sys.path) is None:
        return (f"SimGrid's Python module is not installed (Debian: apt-get install "
                f"python3-simgrid; looked in {SIMGRID_PATH} and sys.path)")
    return None


def _simgrid():
    if SIMGRID_PATH not in sys.path:
        sys.path.append(SIMGRID_PATH)
    import simgrid
    return simgrid


def run_in_child(fn: Callable, *args):
    """``fn(*args)`` in a forked child process; its result (or its error) comes back pickled."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        os.close(read)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)   # SimGrid's start-up chatter
            payload = ("ok", fn(*args))
        except BaseException as err:  # report anything, then leave
            payload = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        with os.fdopen(write, "wb") as out:
            pickle.dump(payload, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("the simulation process died without an answer")
    status, value = pickle.loads(data)
    if status != "ok":
        raise RuntimeError(f"simulation failed: {value}")
    return value


def play(platform: Platform, jobs: Sequence[Callable[[], Sequence[Round]]],
         traffic: bool = False) -> list:
    """Simulated seconds of each job (a function giving its rounds), played one after another
    on an idle platform. With ``traffic``, each result is ``(seconds, {link class: [bytes on
    the busiest link of the class, bytes on all of them]})``."""
    missing = simgrid_missing()
    if missing:
        raise RuntimeError(missing)
    return run_in_child(_simulate, platform, list(jobs), traffic)


def traffic_by_class(platform: Platform, rounds: Sequence[Round]) -> Dict[str, List[int]]:
    """Bytes per link class: the busiest link's and the sum over the class's links."""
    out: Dict[str, List[int]] = {}
    for name, nbytes in link_bytes(platform, rounds).items():
        entry = out.setdefault(name.split("/")[0], [0, 0])
        entry[0] = max(entry[0], nbytes)
        entry[1] += nbytes
    return out


def _simulate(platform: Platform, jobs, traffic: bool = False) -> list:
    sg = _simgrid()
    engine = sg.Engine(["mpistrat-simulate", "--cfg=network/model:CM02",
                        "--cfg=network/crosstraffic:0", "--cfg=network/TCP-gamma:1e18",
                        "--log=root.thres:critical"])
    hosts, machine = _build(sg, platform)
    results: List[float] = []

    def driver():
        exact: Dict[tuple, float] = {}
        alike: Dict[tuple, float] = {}
        for job in jobs:
            start = engine.clock
            rounds = job()
            for r in rounds:
                _play_round(sg, engine, platform, hosts, machine, r, exact, alike)
            seconds = engine.clock - start
            results.append((seconds, traffic_by_class(platform, rounds)) if traffic else seconds)

    sg.Actor.create("driver", hosts[0], driver)
    engine.run()
    return results


def _play_round(sg, engine, platform: Platform, hosts, machine, r: Round,
                exact: Dict[tuple, float], alike: Dict[tuple, float]) -> None:
    key = r.key()
    seconds = exact.get(key)
    free = None
    if seconds is None and machine is None:
        free = _contention_free_key(platform, r)
        seconds = alike.get(free) if free is not None else None
    if seconds is not None:
        if seconds > 0:
            sg.this_actor.sleep_for(seconds)
        return
    start = engine.clock
    # 1. every message at once (on a shared machine, with the CPU time of both ends)
    # (an empty message travels as one byte: many 0-byte messages at once took SimGrid
    # milliseconds of simulated time instead of a latency)
    comms = [sg.Comm.sendto_async(hosts[src], hosts[dst], max(int(n), 1))
             for src, dst, n in r.transfers]
    execs = []
    if machine is not None:
        for src, dst, n in r.transfers:
            work = n * platform.cpu_per_byte(src, dst) * _GIGA
            if work > 0:
                execs += [_start_exec(sg, machine, work), _start_exec(sg, machine, work)]
    sg.Comm.wait_all(comms)
    for x in execs:
        x.wait()
    # 2. the reductions of what arrived
    rate = platform.spec.combine_rate
    execs = [_start_exec(sg, machine if machine is not None else hosts[rank], n / rate * _GIGA)
             for rank, n in r.combines if n > 0]
    for x in execs:
        x.wait()
    # 3. the software's own cost per round, on each rank that took part (CPU time: on a shared
    # machine the ranks take turns on its cores)
    overhead = platform.overhead.get(r.software, 0.0)
    if overhead > 0 and machine is not None:
        ranks = {src for src, _, _ in r.transfers} | {dst for _, dst, _ in r.transfers}
        for x in [_start_exec(sg, machine, overhead * _GIGA) for _ in ranks]:
            x.wait()
    elif overhead > 0:
        sg.this_actor.sleep_for(overhead)
    seconds = engine.clock - start
    exact[key] = seconds
    if free is not None:
        alike[free] = seconds


def _start_exec(sg, host, flops: float):
    x = sg.this_actor.exec_init(flops)
    x.host = host
    x.start()
    return x


def _contention_free_key(platform: Platform, r: Round) -> Optional[tuple]:
    """For a round where no link carries two messages and no rank reduces twice: the link
    classes and sizes of its messages, which alone decide its time; else ``None``."""
    used = set()
    flows = []
    for src, dst, n in r.transfers:
        shared, classes = platform.route_info(src, dst)
        for name in shared:
            if name in used:
                return None
            used.add(name)
        flows.append((classes, n))
    ranks = [rank for rank, _ in r.combines]
    if len(ranks) != len(set(ranks)):
        return None
    return (tuple(sorted(flows)), tuple(sorted(n for _, n in r.combines)), r.software)


def _build(sg, platform: Platform):
    """The SimGrid platform; returns the rank hosts and the shared machine (or None)."""
    spec = platform.spec
    sizes = spec.node_sizes
    made: Dict[str, object] = {}

    def links(zone, *names):
        for name in names:
            if name not in made:
                spec_link = platform.link(name)
                made[name] = zone.create_link(name, spec_link.bandwidth).set_latency(
                    spec_link.latency).seal()
        return [sg.LinkInRoute(made[name]) for name in names]

    flat = spec.network == "flat"
    per_parent = spec.leaf_nodes if spec.network == "fat-tree" else spec.group_nodes
    switch_kind = "leaf" if spec.network == "fat-tree" else "group"
    root = (sg.NetZone.create_star_zone if flat else sg.NetZone.create_full_zone)("cluster")
    parents = []   # fat-tree leaves, dragonfly groups: (zone, gateway)
    if not flat:
        for index in range(-(-len(sizes) // per_parent)):
            zone = sg.NetZone.create_full_zone(f"{switch_kind}zone/{index}")
            zone.set_parent(root)
            # the switch: a zone of its own holding one router (SimGrid routes to a zone's
            # gateway through the child zone that holds it)
            inner = sg.NetZone.create_full_zone(f"{switch_kind}switch/{index}")
            inner.set_parent(zone)
            router = inner.create_router(f"{switch_kind}gw/{index}")
            inner.seal()
            parents.append((zone, inner, router))
    hosts, nodes, rank = [], [], 0
    for node, size in enumerate(sizes):
        outer = root if flat else parents[node // per_parent][0]
        zone = sg.NetZone.create_full_zone(f"node/{node}")
        zone.set_parent(outer)
        gateway = zone.create_router(f"gw/{node}")
        port = zone.create_link(f"port/{node}", 1e15).seal()
        mine = [zone.create_host(f"rank/{r}", _GIGA).seal() for r in range(rank, rank + size)]
        for i, a in enumerate(mine):
            zone.add_route(a.netpoint, gateway, None, None, [sg.LinkInRoute(port)], True)
            for j, b in enumerate(mine):
                if i != j:
                    zone.add_route(a.netpoint, b.netpoint, None, None,
                                   links(zone, f"in-up/{rank + i}", f"in-down/{rank + j}"), False)
        zone.seal()
        if flat:  # a star: each node's NIC to the one switch
            root.add_route(zone.netpoint, None, gateway, None, links(root, f"nic-up/{node}",
                                                                     "switch"), False)
            root.add_route(None, zone.netpoint, None, gateway, links(root, f"nic-down/{node}"),
                           False)
        nodes.append((zone, gateway))
        hosts += mine
        rank += size
    for index, (zone, inner, router) in enumerate(parents):
        switch = f"{switch_kind}/{index}"
        members = [n for n in range(len(sizes)) if n // per_parent == index]
        for a in members:
            za, ga = nodes[a]
            zone.add_route(za.netpoint, inner.netpoint, ga, router,
                           links(zone, f"nic-up/{a}", switch), False)
            zone.add_route(inner.netpoint, za.netpoint, router, ga, links(zone, f"nic-down/{a}"),
                           False)
            for b in members:
                if a != b:
                    zb, gb = nodes[b]
                    zone.add_route(za.netpoint, zb.netpoint, ga, gb,
                                   links(zone, f"nic-up/{a}", switch, f"nic-down/{b}"), False)
        zone.seal()
    for a, (za, _, ga) in enumerate(parents):
        for b, (zb, _, gb) in enumerate(parents):
            if a != b:
                middle = (f"leaf-up/{a}", "spine", f"leaf-down/{b}", f"leaf/{b}") \
                    if spec.network == "fat-tree" else (f"global/{a}-{b}", f"group/{b}")
                root.add_route(za.netpoint, zb.netpoint, ga, gb, links(root, *middle), False)
    machine = None
    if spec.shared_cores > 0:
        machine = root.create_host("machine", _GIGA)
        machine.core_count = spec.shared_cores
        machine.seal()
    root.seal()
    return hosts, machine
