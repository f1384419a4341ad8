"""Closed-form costs in the alpha-beta model: checks on the simulator, and the calibration fit.

A message of ``m`` bytes costs ``alpha + m / beta``; reducing ``m`` bytes costs
``m / gamma`` (``gamma``: bytes reduced per second). The ring all-reduce of
``m`` bytes over ``n`` ranks on a flat network, one rank per node::

    T = 2 (n-1) (alpha + o + m / (n beta)) + (n-1) m / (n gamma)

(``o``: the software's overhead per round)::

    >>> round(ring_allreduce_seconds(4, 4 << 20, 10e-6, 1e9, 4e9) * 1e3, 3)
    7.138

``processor_sharing`` is the makespan of work shared fairly by a machine's cores
(each piece on at most one core), as SimGrid shares a multi-core host::

    >>> processor_sharing([1.0, 1.0, 1.0, 1.0], cores=2)
    2.0
"""

from dataclasses import dataclass
from typing import Sequence, Tuple

__all__ = ["ring_allreduce_seconds", "rabenseifner_allreduce_seconds", "processor_sharing",
           "round_seconds", "round_parts", "parts_seconds", "RoundParts"]


def ring_allreduce_seconds(n: int, nbytes: float, alpha: float, beta: float, gamma: float,
                           overhead: float = 0.0) -> float:
    """The ring all-reduce on a flat network of ``n`` nodes with one rank each."""
    if n == 1:
        return 0.0
    chunk = nbytes / n
    return 2 * (n - 1) * (alpha + overhead + chunk / beta) + (n - 1) * chunk / gamma


def rabenseifner_allreduce_seconds(n: int, nbytes: float, alpha: float, beta: float,
                                   gamma: float, overhead: float = 0.0) -> float:
    """Recursive halving-doubling on a power-of-two ``n`` (flat network, one rank per node)."""
    if n == 1:
        return 0.0
    if n & (n - 1):
        raise ValueError(f"the closed form holds for a power of two ranks, not {n}")
    levels = n.bit_length() - 1
    moved = nbytes * (n - 1) / n          # halves, quarters, ... one way
    return 2 * levels * (alpha + overhead) + 2 * moved / beta + moved / gamma


def processor_sharing(works: Sequence[float], cores: int) -> float:
    """Time until all ``works`` (core-seconds) are done, shared equally, at most one core each."""
    remaining = sorted(w for w in works if w > 0)
    clock, done = 0.0, 0.0
    while remaining:
        active = len(remaining)
        rate = min(1.0, cores / active)
        step = (remaining[0] - done) / rate
        clock += step
        done = remaining[0]
        remaining = [w for w in remaining if w > done + 1e-15]
    return clock


@dataclass(frozen=True)
class RoundParts:
    """What a round's time is made of, apart from the CPU and software parameters."""

    comm: float                      # seconds until the last message has arrived
    net_bytes: Tuple[int, ...]       # each message between nodes (shared machine: CPU work)
    intra_bytes: Tuple[int, ...]     # each message inside a node
    reductions: Tuple[int, ...]      # bytes of each reduction
    busiest_rank: int                # bytes the busiest rank reduces (own cores)
    ranks: int                       # ranks that take part
    software: str


def round_parts(platform, r) -> RoundParts:
    """The parts of round ``r`` on ``platform`` (see ``round_seconds``)."""
    sharing: dict = {}
    for src, dst, _ in r.transfers:
        for name in platform.route(src, dst):
            sharing[name] = sharing.get(name, 0) + 1
    comm, net, intra = 0.0, [], []
    for src, dst, nbytes in r.transfers:
        links = [platform.link(name) for name in platform.route(src, dst)]
        bandwidth = min(link.bandwidth / (1 if link.fatpipe else sharing[link.name])
                        for link in links)
        comm = max(comm, sum(link.latency for link in links) + nbytes / bandwidth)
        (net if platform.crosses_nodes(src, dst) else intra).append(nbytes)
    per_rank: dict = {}
    for rank, nbytes in r.combines:
        per_rank[rank] = per_rank.get(rank, 0) + nbytes
    ranks = {s for s, _, _ in r.transfers} | {d for _, d, _ in r.transfers}
    return RoundParts(comm, tuple(net), tuple(intra),
                      tuple(n for _, n in r.combines if n > 0),
                      max(per_rank.values(), default=0), len(ranks), r.software)


def parts_seconds(parts: RoundParts, cores: int, net_cpu: float, intra_cpu: float,
                  combine_rate: float, overhead: float) -> float:
    """A round's time from its parts: messages (with, on ``cores`` shared cores, the CPU work
    of both ends), then reductions, then the software's overhead on every rank taking part."""
    if not cores:
        return parts.comm + parts.busiest_rank / combine_rate + (overhead if parts.ranks else 0.0)
    cpu = [n * net_cpu for n in parts.net_bytes] * 2 + [n * intra_cpu for n in parts.intra_bytes] * 2
    return (max(parts.comm, processor_sharing(cpu, cores))
            + processor_sharing([n / combine_rate for n in parts.reductions], cores)
            + (processor_sharing([overhead] * parts.ranks, cores) if overhead > 0 else 0.0))


def round_seconds(platform, r) -> float:
    """A round's time in the simulator's model, worked out without SimGrid: exact where no
    link carries two of its messages (then each message runs at its route's slowest link);
    a link shared by ``k`` messages is counted at ``1/k`` of its bandwidth for each (an
    approximation of SimGrid's max-min sharing, used only to fit the calibration).
    See ``player.py`` for the three phases of a round."""
    spec = platform.spec
    return parts_seconds(round_parts(platform, r), spec.shared_cores, spec.net_cpu_per_byte,
                         spec.intra_cpu_per_byte, spec.combine_rate,
                         platform.overhead.get(r.software, 0.0))
