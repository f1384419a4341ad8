"""Predictions: what our engine does for a gradient set on a described cluster, and how long.

``step(spec, tensors)`` takes the engine's own decisions, all pure: the fusion plan
(``collectives/fusion.py``: small tensors by dtype into buckets, 1 MiB and more
alone), the dtype each travels as (``backends/base.wire_dtype``) and the algorithm
for each bucket (``algorithms.explain_algorithm`` with the cluster's topology), then
simulates every distinct bucket once::

    >>> spec = infiniband(2, 8)
    >>> spec.nic_bandwidth, spec.network
    (25000000000.0, 'fat-tree')

``infiniband`` holds the parameters of the InfiniBand-class cluster of docs/scaling.md;
``PARAMETERS`` says where each comes from.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mpistrat.collectives.algorithms import explain_algorithm
from mpistrat.collectives.fusion import plan_buckets
from mpistrat.collectives.options import DEFAULT_BYTES_PER_PACK
from mpistrat.collectives.topology import make_topology
from mpistrat.simulate import programs
from mpistrat.simulate.models import count
from mpistrat.simulate.platform import ClusterSpec, Platform
from mpistrat.simulate.player import play

__all__ = ["infiniband", "PARAMETERS", "engine_choice", "simulate", "step", "wire_itemsize"]

# name: (value, where it comes from)
PARAMETERS = {
    "nic_bandwidth": (25e9, "200 Gbit/s per direction: an HDR InfiniBand NIC (ConnectX-6), one "
                            "per node"),
    "nic_latency": (1.5e-6, "MPI ping-pong latency over HDR InfiniBand is about 1-1.5 us "
                            "(osu_latency class figures); both NICs included"),
    "switch_latency": (130e-9, "per switch crossed: HDR InfiniBand switches (Quantum QM8700 "
                               "class) quote about 130 ns port to port"),
    "intra_bandwidth": (300e9, "per GPU and direction inside a node: NVLink 3 (A100, 12 links "
                               "x 25 GB/s), the generation that came with HDR NICs; NVLink 4 "
                               "(H100) would be 450 GB/s"),
    "intra_latency": (2e-6, "a small GPU-to-GPU message through NVLink and the CUDA runtime: "
                            "a few microseconds"),
    "combine_rate": (500e9, "bytes a GPU reduces per second: a reduction reads two buffers "
                            "and writes one, at about 1.5 TB/s of HBM2e"),
    "python_overhead": (5e-6, "one round of our executor beyond its message (a Python loop "
                              "step, one Sendrecv call, one NumPy call); calibrated at "
                              "tens of us on our shared 2-core machine (docs/scaling.md), a "
                              "few us on a dedicated core"),
    "leaf_nodes": (16, "nodes per fat-tree leaf switch (a 40-port HDR switch has room for 20 "
                       "down and 20 up)"),
    "oversubscription": (1.0, "non-blocking fat-tree; 2 and 4 shown as variants"),
}


def infiniband(nodes: int, ranks_per_node: int, **overrides) -> ClusterSpec:
    """The InfiniBand-class GPU cluster of the predictions (``PARAMETERS``), ``overrides``
    applied (``nic_bandwidth=...``, ``network="dragonfly"``, ...)."""
    values = {k: v for k, (v, _) in PARAMETERS.items() if k != "python_overhead"}
    overhead = overrides.pop("python_overhead", PARAMETERS["python_overhead"][0])
    values.update(network="fat-tree", overhead=(("python", overhead), ("mpi", 0.0)),
                  label="InfiniBand-class fat-tree")
    values.update(overrides)
    return ClusterSpec(node_sizes=(ranks_per_node,) * nodes, **values)


def engine_choice(spec: ClusterSpec, nbytes: int) -> Tuple[str, str]:
    """``(algorithm, why)``: what our engine picks for one buffer on this cluster."""
    nodes = Platform(spec).node_of
    topology = make_topology(list(nodes), [None] * len(nodes))
    return explain_algorithm(nbytes, len(nodes), topology=topology)


def wire_itemsize(dtype: str) -> Tuple[str, int]:
    """The dtype a tensor of ``dtype`` travels as through the host engine, and its size."""
    from mpistrat.collectives.backends.base import wire_dtype
    from mpistrat.collectives.reduce_op import ReduceOp
    if dtype == "bfloat16":
        try:
            import ml_dtypes
            real = np.dtype(ml_dtypes.bfloat16)
        except ImportError:      # without ml_dtypes: two bytes, as bfloat16 is
            return "bfloat16", 2
    else:
        real = np.dtype(dtype)
    wire = wire_dtype(real, ReduceOp.SUM)
    return str(wire), wire.itemsize


def simulate(spec: ClusterSpec, requests: Sequence[Tuple[str, int, int]],
             traffic: bool = False) -> list:
    """Simulate ``(algorithm, nbytes, itemsize)`` requests on ``spec`` (equal ones once)."""
    platform = Platform(spec)
    nodes = platform.node_of
    distinct = list(dict.fromkeys(requests))
    jobs = [lambda a=a, n=n, i=i: programs.rounds(a, n // i, i, nodes) for a, n, i in distinct]
    results = dict(zip(distinct, play(platform, jobs, traffic)))
    return [results[r] for r in requests]


def step(spec: ClusterSpec, tensors: Sequence[Tuple[Tuple[int, ...], str]],
         compute_seconds: Optional[float] = None,
         bytes_per_pack: int = DEFAULT_BYTES_PER_PACK) -> dict:
    """One data-parallel step's all-reduce of ``tensors`` ((shape, dtype) pairs) on ``spec``:
    the buckets (bytes, algorithm, why, seconds), the total, the bytes per link class and,
    given the compute time, the scaling efficiency ``compute / (compute + all-reduce)``."""
    wires = [wire_itemsize(dtype) for _, dtype in tensors]
    nbytes = [count(shape) * size for (shape, _), (_, size) in zip(tensors, wires)]
    plan = plan_buckets(nbytes, [w for w, _ in wires], bytes_per_pack)
    buckets = []
    for bucket in plan:
        total = sum(nbytes[i] for i in bucket.indices)
        algorithm, why = engine_choice(spec, total)
        buckets.append({"tensors": len(bucket.indices), "dtype": bucket.dtype, "bytes": total,
                        "itemsize": wires[bucket.indices[0]][1], "algorithm": algorithm,
                        "why": why})
    results = simulate(spec, [(b["algorithm"], b["bytes"], b["itemsize"]) for b in buckets],
                       traffic=True)
    links: Dict[str, List[int]] = {}
    for bucket, (seconds, traffic) in zip(buckets, results):
        bucket["seconds"] = seconds
        for kind, (busiest, total) in traffic.items():
            entry = links.setdefault(kind, [0, 0])
            entry[0] += busiest
            entry[1] += total
    allreduce = sum(b["seconds"] for b in buckets)
    out = {"ranks": spec.ranks, "nodes": len(spec.node_sizes), "tensors": len(tensors),
           "bytes": sum(nbytes), "buckets": buckets, "allreduce_seconds": allreduce,
           "link_bytes": {k: {"busiest_link": v[0], "all_links": v[1]}
                          for k, v in sorted(links.items())}}
    if compute_seconds is not None:
        out["compute_seconds"] = compute_seconds
        out["efficiency"] = compute_seconds / (compute_seconds + allreduce)
    return out
