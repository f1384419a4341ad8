"""Fitting the namespace cluster's parameters from recorded measurements (pure, no SimGrid).

The measurements are benchmarks/calibrate_sim.py's JSON lines. What is fitted, and from what:

* ``latency`` and ``bandwidth`` of the host links (per link setting, ``unshaped`` or
  ``1gbit``) and of shared memory inside a host, from ping-pong: the bandwidth is the
  slope of the time over the sizes of 1 MiB and more, the latency the median of what
  is left of the small messages (16 KiB and less);
* ``combine_rate``: NumPy's reduction rate, measured directly;
* ``python_overhead`` and ``mpi_overhead``: the CPU time one round of our executor,
  or of MPI's own algorithms, costs each rank taking part beyond its message, from
  the times of 4 KiB and less (our ring and halving-doubling; MPI's ``Allreduce``);
* ``net_cpu_per_byte`` and ``intra_cpu_per_byte``: the CPU time each end spends per
  byte it moves (every host runs on the same few cores), from our ring and
  halving-doubling at 1 MiB and more over unshaped links: across hosts on the
  layouts of one rank per host, then in a host on the layouts with two.

Each is the value (on a grid) with the least sum of ``|log(model / measured)|``,
where the model is the simulator's own round model worked out in closed form
(``closed_form.round_seconds``, exact for rounds where no link carries two
messages, as in these algorithms on these layouts), so the fit needs no
simulation; every algorithm is then checked by simulation (``validate.py``).

    >>> cal = Calibration.from_json(Calibration(
    ...     {"unshaped": (3e-5, 1e9)}, (5e-6, 3e9), 2e9, 2, 1e-5, 1e-6, 3e-10, 2e-10).to_json())
    >>> spec = cal.spec((1, 1), "unshaped")
    >>> spec.nic_bandwidth, spec.shared_cores
    (1000000000.0, 2)
"""

import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Dict, Iterable, List, Sequence, Tuple

from mpistrat.simulate import programs
from mpistrat.simulate.closed_form import parts_seconds, round_parts
from mpistrat.simulate.platform import ClusterSpec, Platform

__all__ = ["Calibration", "fit", "load_records", "fit_latency_bandwidth"]


@dataclass(frozen=True)
class Calibration:
    """The fitted parameters of our namespace cluster (seconds, bytes per second)."""

    net: Dict[str, Tuple[float, float]]   # link setting -> (latency, bandwidth) between hosts
    shm: Tuple[float, float]              # (latency, bandwidth) inside a host
    combine_rate: float
    cores: int
    python_overhead: float
    mpi_overhead: float
    net_cpu_per_byte: float
    intra_cpu_per_byte: float

    def spec(self, node_sizes: Sequence[int], link: str) -> ClusterSpec:
        """The simulated cluster: these hosts on one bridge, every rank on the shared cores."""
        if link not in self.net:
            raise ValueError(f"no calibration for links {link!r}; have {sorted(self.net)}")
        latency, bandwidth = self.net[link]
        return ClusterSpec(node_sizes=tuple(node_sizes), network="flat",
                           nic_bandwidth=bandwidth, nic_latency=latency,
                           intra_bandwidth=self.shm[1], intra_latency=self.shm[0],
                           combine_rate=self.combine_rate,
                           overhead=(("python", self.python_overhead),
                                     ("mpi", self.mpi_overhead)),
                           shared_cores=self.cores, net_cpu_per_byte=self.net_cpu_per_byte,
                           intra_cpu_per_byte=self.intra_cpu_per_byte,
                           label=f"namespace cluster, {link}")

    def to_json(self) -> str:
        data = asdict(self)
        data["net"] = {k: list(v) for k, v in self.net.items()}
        data["shm"] = list(self.shm)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        data["net"] = {k: tuple(v) for k, v in data["net"].items()}
        data["shm"] = tuple(data["shm"])
        return cls(**data)


def load_records(lines: Iterable[str]) -> List[dict]:
    """The JSON objects among ``lines`` (other output is skipped)."""
    out = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def fit_latency_bandwidth(points: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """``(latency, bandwidth)`` from ``(bytes, seconds)`` of single messages."""
    points = sorted(points)   # the same sums in any order of the records
    large = [(m, t) for m, t in points if m >= 1 << 20]
    small = [(m, t) for m, t in points if m <= 16 << 10]
    if len(large) < 2 or not small:
        raise ValueError(f"need two sizes of 1 MiB or more and one of 16 KiB or less, "
                         f"got {sorted(m for m, _ in points)}")
    # least squares of t = a + m / b, weighted by 1/t (relative errors)
    w = [1 / t for _, t in large]
    sw = sum(w)
    mx = sum(wi * m for wi, (m, _) in zip(w, large)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, large)) / sw
    slope = sum(wi * (m - mx) * (t - my) for wi, (m, t) in zip(w, large)) / \
        sum(wi * (m - mx) ** 2 for wi, (m, _) in zip(w, large))
    if slope <= 0:
        raise ValueError(f"times do not grow with size: {large}")
    bandwidth = 1 / slope
    latency = max(0.0, statistics.median(t - m / bandwidth for m, t in small))
    return latency, bandwidth


def _layout(record: dict) -> Tuple[int, int]:
    hosts, per_host = record["layout"].split("x")
    return int(hosts), int(per_host)


def _grid_fit(points, predict, low: float, high: float, steps: int = 200) -> float:
    """The value in ``[low, high]`` with the least sum of |log(model / measured)| (robust to
    the odd point a busy machine slowed down)."""
    best, best_err = low, math.inf
    for i in range(steps + 1):
        value = low + (high - low) * i / steps
        err = sum(abs(math.log(predict(p, value) / p["seconds"])) for p in points)
        if err < best_err:
            best, best_err = value, err
    return best


class _Model:
    """Predicted times of measured points for trial parameters, by ``closed_form`` (no
    SimGrid: the fit tries hundreds of values); each round's parts are worked out once."""

    def __init__(self, points: Sequence[dict], calibration: "Calibration"):
        self.parts = {}
        for p in points:
            key = (p["ran"], p["bytes"], p["layout"], p["link"])
            if key not in self.parts:
                hosts, per_host = _layout(p)
                nodes = [h for h in range(hosts) for _ in range(per_host)]
                platform = Platform(calibration.spec((per_host,) * hosts, p["link"]))
                self.parts[key] = [round_parts(platform, r) for r in
                                   programs.rounds(p["ran"], p["bytes"] // 4, 4, nodes)]

    def seconds(self, p: dict, c: "Calibration") -> float:
        total = 0.0
        for parts in self.parts[(p["ran"], p["bytes"], p["layout"], p["link"])]:
            overhead = c.python_overhead if parts.software == "python" else c.mpi_overhead
            total += parts_seconds(parts, c.cores, c.net_cpu_per_byte, c.intra_cpu_per_byte,
                                   c.combine_rate, overhead)
        return max(1e-9, total)


def fit(records: Sequence[dict]) -> Calibration:
    """The calibration from benchmarks/calibrate_sim.py's records (see the module docstring)."""
    pings: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
    for r in records:
        if r.get("kind") == "pingpong":
            key = ("shm", "any") if r["pair"] == "shm" else ("net", r["link"])
            pings.setdefault(key, []).append((r["bytes"], r["seconds"]))
    net = {link: fit_latency_bandwidth(p) for (pair, link), p in sorted(pings.items())
           if pair == "net"}
    if "unshaped" not in net:
        raise ValueError("no ping-pong between hosts over unshaped links in the records")
    if ("shm", "any") not in pings:
        raise ValueError("no ping-pong inside a host: measure a layout with 2 ranks per host")
    shm = fit_latency_bandwidth(pings[("shm", "any")])
    combines = [r["bytes"] / r["seconds"] for r in records if r.get("kind") == "combine"]
    if not combines:
        raise ValueError("no reduction-rate measurement in the records")
    combine_rate = statistics.median(combines)
    cores = min(r["cores"] for r in records if r.get("kind") == "meta")
    measured = [r for r in records if r.get("kind") == "allreduce" and r["link"] in net
                and r["seconds"] > 0]
    trial = Calibration(net, shm, combine_rate, cores, 0.0, 0.0, 0.0, 0.0)

    def fitted(points, name, high):
        model = _Model(points, trial)
        return _grid_fit(points, lambda p, v: model.seconds(p, replace(trial, **{name: v})),
                         0.0, high)

    # 1. the software's overhead per round, from small messages: our executor (ring and
    # halving-doubling), then MPI's own algorithms
    small = [r for r in measured if r["bytes"] <= 4 << 10]
    ours = [r for r in small if r["ran"] in ("ring", "rabenseifner")]
    theirs = [r for r in small if r["ran"] == "mpi"]
    if not ours or not theirs:
        raise ValueError("no small-message measurements of our ring and MPI's own all-reduce")
    overhead = fitted(ours, "python_overhead", 2e-3)
    trial = replace(trial, python_overhead=overhead)
    mpi_overhead = fitted(theirs, "mpi_overhead", 1e-3)
    trial = replace(trial, mpi_overhead=mpi_overhead)
    # 2. CPU per byte each end spends across hosts (one rank per host), then inside a host,
    # from our ring and halving-doubling at 1 MiB and more over unshaped links
    large = [r for r in measured if r["bytes"] >= 1 << 20 and r["link"] == "unshaped"
             and r["ran"] in ("ring", "rabenseifner")]
    flat = [r for r in large if _layout(r)[1] == 1 and _layout(r)[0] > 1]
    unshaped_bw = net["unshaped"][1]
    net_cpu = fitted(flat, "net_cpu_per_byte", 2.0 / unshaped_bw) if flat else 0.0
    trial = replace(trial, net_cpu_per_byte=net_cpu)
    paired = [r for r in large if _layout(r)[1] > 1]
    intra_cpu = fitted(paired, "intra_cpu_per_byte", 2.0 / shm[1]) if paired else 1.0 / shm[1]
    return Calibration(net=net, shm=shm, combine_rate=combine_rate, cores=cores,
                       python_overhead=overhead, mpi_overhead=mpi_overhead,
                       net_cpu_per_byte=net_cpu,
                       intra_cpu_per_byte=intra_cpu)
