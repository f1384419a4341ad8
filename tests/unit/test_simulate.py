"""The simulator (mpistrat/simulate): schedules, platform, SimGrid player, calibration, plan.

Tests that play on SimGrid skip, with the reason, where its Python module is missing
(set-up installs Debian's python3-simgrid); the rest are pure.
"""

import json
import math
import os
import random
from pathlib import Path

import pytest

from mpistrat.collectives import schedules
from mpistrat.simulate import closed_form, openmpi, plan, programs
from mpistrat.simulate.calibrate import Calibration, fit, load_records
from mpistrat.simulate.platform import ClusterSpec, Platform, link_bytes
from mpistrat.simulate.player import play, run_in_child, simgrid_missing
from mpistrat.simulate.rounds import relabel

MEASUREMENTS = Path(__file__).with_name("sim_measurements.jsonl")
needs_simgrid = pytest.mark.skipif(simgrid_missing() is not None,
                                   reason=str(simgrid_missing()))
LAYOUTS = {"one-node": [0] * 6, "one-per-node": list(range(5)), "pairs": [0, 0, 1, 1, 2, 2],
           "uneven": [0, 0, 0, 1], "uneven-3": [0, 1, 1, 1, 2, 2, 2], "single": [0]}


# --- schedules and rounds (pure) ---

@pytest.mark.parametrize("algorithm", programs.ENGINE_ALGORITHMS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_round_matches_sends_to_receives(algorithm, layout):
    nodes = LAYOUTS[layout]
    for count in (0, 1, 7, 1000, 4099):
        rounds = programs.rounds(algorithm, count, 4, nodes)   # zip_steps checks matching
        for r in rounds:
            assert all(src != dst for src, dst, _ in r.transfers)


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner"])
def test_our_flat_algorithms_move_the_bandwidth_optimal_bytes(algorithm):
    for n in (2, 4, 8):
        count = n * 1024
        sent = {}
        for r in programs.rounds(algorithm, count, 4, [0] * n):
            for src, _, nbytes in r.transfers:
                sent[src] = sent.get(src, 0) + nbytes
        assert all(v == 2 * (n - 1) * count * 4 // n for v in sent.values()), sent


def test_the_simulated_rounds_are_the_engine_events():
    """Rounds and events come from the same schedules: every step event's send is a
    transfer of the matching round, for uneven layouts too."""
    for name, nodes in LAYOUTS.items():
        events = programs.events("hierarchical", 4099, nodes)
        rounds = programs.rounds("hierarchical", 4099, 4, nodes)
        sent = sorted((rank, e[1][0], (e[1][2] - e[1][1]) * 4) for rank, evs in enumerate(events)
                      for e in evs if e[0] == "step" and e[1] is not None)
        in_node = sorted((s, d, n) for r in rounds if r.software == "python"
                         for s, d, n in r.transfers)
        assert sent == in_node, name


def test_rabenseifner_folds_extra_ranks_in_and_out():
    p, new = schedules.power_of_two_fold(4, 6)
    assert (p, new) == (4, 2)
    steps = [schedules.rabenseifner_steps(r, 6, 12) for r in range(6)]
    assert all(len(s) == len(steps[0]) for s in steps)
    assert steps[1][0].send == (0, 0, 12) and steps[1][-1].recv == (0, 0, 12)


def test_open_mpi_decisions():
    assert openmpi.allreduce_algorithm(2, 1024) == "recursive_doubling"
    assert openmpi.allreduce_algorithm(3, 100 << 10) == "ring"      # segmented ring, unsegmented
    assert openmpi.allreduce_algorithm(4, 64 << 20) == "rabenseifner"
    assert openmpi.allreduce_algorithm(128, 64 << 10) == "nonoverlapping"
    assert openmpi.allreduce_algorithm(1024, 1 << 10) == "nonoverlapping"
    assert openmpi.reduce_algorithm(4, 1 << 20) == "linear"
    assert openmpi.bcast_algorithm(3, 1 << 20) == "binary_tree"
    assert openmpi.bcast_algorithm(1024, 1 << 20) == "scatter_allgather"
    for size in (2, 3, 5, 16, 100, 1024):
        for nbytes in (4, 4096, 1 << 20):
            programs.rounds("mpi", nbytes // 4, 4, [0] * size)
            programs.rounds("reduce_broadcast", nbytes // 4, 4, [0] * size)


def test_routes_and_link_bytes():
    p = Platform(ClusterSpec(node_sizes=(2, 2, 2), network="fat-tree", leaf_nodes=2))
    assert p.route(0, 1) == ("in-up/0", "in-down/1")
    assert p.route(1, 2) == ("nic-up/0", "leaf/0", "nic-down/1")
    assert p.route(3, 4)[2:5] == ("leaf-up/0", "spine", "leaf-down/1")
    ring = programs.rounds("ring", 600, 4, p.node_of)
    totals = link_bytes(p, ring)
    assert totals["nic-up/0"] == 2 * 5 * 100 * 4 and "spine" not in totals


def test_cluster_spec_refuses_nonsense():
    for bad in ({"node_sizes": ()}, {"node_sizes": (0,)}, {"node_sizes": (2,), "nic_bandwidth": -1},
                {"node_sizes": (2,), "network": "torus"},
                {"node_sizes": (2,), "nic_latency": float("nan")}):
        with pytest.raises(ValueError, match="invalid cluster"):
            ClusterSpec(**bad)


# --- SimGrid ---

@needs_simgrid
def test_the_simulator_reproduces_the_closed_form_ring_and_halving_doubling():
    alpha, beta, gamma, o = 10e-6, 1e9, 4e9, 3e-6
    cases = [(n, nbytes) for n in (2, 4, 8, 16) for nbytes in (4 << 10, 1 << 20, 64 << 20)]
    for network in ("flat", "fat-tree"):
        # one platform of 16 nodes; a job over n ranks uses the first n
        platform = Platform(ClusterSpec(node_sizes=(1,) * 16, network=network,
                                        nic_bandwidth=beta, nic_latency=alpha,
                                        combine_rate=gamma, leaf_nodes=4,
                                        overhead=(("python", o), ("mpi", 0.0))))
        jobs = [(a, f, n, b) for a, f in (("ring", closed_form.ring_allreduce_seconds),
                                          ("rabenseifner",
                                           closed_form.rabenseifner_allreduce_seconds))
                for n, b in cases]
        times = play(platform, [lambda a=a, n=n, b=b: programs.rounds(a, b // 4, 4, list(range(n)))
                                for a, _, n, b in jobs])
        for (algorithm, formula, n, nbytes), simulated in zip(jobs, times):
            expected = formula(n, nbytes, alpha, beta, gamma, o)
            assert simulated == pytest.approx(expected, rel=0.01), (network, algorithm, n, nbytes)


@needs_simgrid
def test_simgrid_routes_are_the_platform_routes():
    def routes(platform):
        from mpistrat.simulate import player
        sg = player._simgrid()
        sg.Engine(["test", "--log=root.thres:critical"])
        hosts, _ = player._build(sg, platform)
        n = len(hosts)
        return {(a, b): tuple(l.name for l in hosts[a].route_to(hosts[b])[0]
                              if not l.name.startswith("port/"))
                for a in range(n) for b in range(n) if a != b}

    for network in ("flat", "fat-tree", "dragonfly"):
        p = Platform(ClusterSpec(node_sizes=(2, 1, 2, 1, 1), network=network, leaf_nodes=2,
                                 group_nodes=2))
        got = run_in_child(routes, p)
        assert got == {k: p.route(*k) for k in got}, network


@needs_simgrid
def test_oversubscription_slows_traffic_across_leaves():
    base = dict(node_sizes=(1,) * 8, network="fat-tree", nic_bandwidth=1e9, leaf_nodes=2)
    jobs = [lambda: programs.rounds("ring", 1 << 22, 4, list(range(8)))]  # one flow per leaf
    fast = play(Platform(ClusterSpec(**base)), jobs)[0]
    oversubscribed = play(Platform(ClusterSpec(**base, oversubscription=4.0)), jobs)[0]
    assert oversubscribed > 1.5 * fast


@needs_simgrid
def test_the_calibration_model_is_what_the_simulator_computes():
    """The fit works the rounds out in closed form on the shared-core platform; for our
    ring and halving-doubling (no link carries two messages) that must be what the
    simulator computes, on uniform and mixed layouts."""
    cal = Calibration({"unshaped": (40e-6, 1e9)}, (20e-6, 2.5e9), 4e9, 2, 30e-6, 10e-6,
                      0.8e-9, 0.3e-9)
    platform = Platform(cal.spec((2, 2, 2, 2), "unshaped"))   # layouts use some of it
    cases = [(a, h, r, b) for a in ("ring", "rabenseifner")
             for h, r in ((2, 1), (3, 1), (4, 1), (2, 2)) for b in (4 << 10, 1 << 20, 16 << 20)]

    def job(algorithm, hosts, per_host, nbytes):
        nodes = [h for h in range(hosts) for _ in range(per_host)]
        ranks = [2 * h + j for h in range(hosts) for j in range(per_host)]
        return relabel(programs.rounds(algorithm, nbytes // 4, 4, nodes), ranks)

    times = play(platform, [lambda c=c: job(*c) for c in cases])
    for case, simulated in zip(cases, times):
        expected = sum(closed_form.round_seconds(platform, r) for r in job(*case))
        assert simulated == pytest.approx(expected, rel=0.01), case


# --- calibration ---

def _records():
    with open(MEASUREMENTS) as handle:
        return load_records(handle)


def test_the_calibration_fit_from_recorded_measurements_is_stable():
    records = _records()
    first = fit(records)
    assert Calibration.from_json(first.to_json()) == first
    assert fit(list(reversed(records))) == first           # order does not matter
    rng = random.Random(21)
    noisy = [dict(r, seconds=r["seconds"] * rng.uniform(0.95, 1.05)) if "seconds" in r else r
             for r in records]
    second = fit(noisy)
    for name in ("combine_rate", "python_overhead", "net_cpu_per_byte", "intra_cpu_per_byte"):
        a, b = getattr(first, name), getattr(second, name)
        assert b == pytest.approx(a, rel=0.25, abs=1e-12), name
    for link, (latency, bandwidth) in first.net.items():
        assert second.net[link][1] == pytest.approx(bandwidth, rel=0.1), link
        assert second.net[link][0] == pytest.approx(latency, rel=0.25, abs=2e-6), link
    assert second.shm[1] == pytest.approx(first.shm[1], rel=0.1)
    assert 0 < first.net["1gbit"][1] < first.net["unshaped"][1]   # shaping is seen
    assert 100e6 < first.net["1gbit"][1] < 130e6                  # 1 Gbit/s is 125e6 B/s


def test_the_fit_refuses_records_that_cannot_calibrate():
    records = [r for r in _records() if r.get("pair") != "shm"]
    with pytest.raises(ValueError, match="inside a host"):
        fit(records)
    with pytest.raises(ValueError, match="ping-pong between hosts"):
        fit([r for r in _records() if r.get("kind") != "pingpong"])


# --- plan ---

@pytest.mark.parametrize("argv, reason", [
    (["--nodes", "0", "--gradient-bytes", "1e6"], "--nodes must be 1 or more"),
    (["--nodes", "2", "--nic-gbits", "-100", "--gradient-bytes", "1e6"], "--nic-gbits must be"),
    (["--nodes", "2", "--ranks-per-node", "0", "--gradient-bytes", "1e6"], "--ranks-per-node"),
    (["--nodes", "2", "--gradient-bytes", "-5"], "--gradient-bytes must be"),
    (["--nodes", "2", "--gradient-bytes", "nan"], "--gradient-bytes must be"),
    (["--nodes", "2", "--gradient-bytes", "1e30"], "--gradient-bytes must be from 4"),   # (a crash)
    (["--nodes", "2", "--tensors", "4x4:complex64"], "unknown dtype"),
    (["--nodes", "2", "--tensors", "4xfour:float32"], "dimensions joined by 'x'"),
    (["--nodes", "2", "--tensors", "0x4:float32"], "1 or more"),
    (["--nodes", "2", "--tensors", "100000000000x100000000000:float32"], "a petabyte"),
    (["--nodes", "2", "--compute-seconds", "0", "--model", "resnet50"], "--compute-seconds"),
])
def test_plan_refuses_nonsense(argv, reason, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan: ") and reason in err


@needs_simgrid
def test_plan_predicts_a_step(capsys, tmp_path):
    picture = tmp_path / "time.png"
    assert plan.main(["--nodes", "4", "--ranks-per-node", "2", "--model", "resnet50",
                      "--compute-seconds", "0.1", "--json", "--plot", str(picture)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ranks"] == 8 and result["tensors"] == 161
    assert sum(b["tensors"] for b in result["buckets"]) == 161
    assert result["allreduce_seconds"] == pytest.approx(sum(b["seconds"] for b in result["buckets"]))
    assert 0 < result["efficiency"] < 1
    assert result["link_bytes"]["nic-up"]["busiest_link"] > 0
    assert [p["ranks"] for p in result["by_nodes"]] == [2, 4, 8]
    assert picture.stat().st_size > 1000
    assert plan.main(["--nodes", "2", "--gradient-bytes", "4e6"]) == 0
    text = capsys.readouterr().out
    assert "all-reduce per step" in text and "why:" in text
    assert math.isfinite(float(text.split("all-reduce per step: ")[1].split()[0]))
    assert os.path.exists(picture)
