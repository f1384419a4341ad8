"""The collective timeline at 1-4 ranks: every rank's collectives merged into one trace."""

import json
import os
import tempfile

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives.algorithms import choose_algorithm
from mpistrat.collectives.topology import comm_topology
from mpistrat.runtime import timeline

pytestmark = pytest.mark.numpy_only("checks the trace's byte counts and algorithms, not values")


@pytest.mark.mpi(min_size=1)
def test_flush_merges_every_ranks_collectives_into_one_chrome_trace(world, strategy):
    path = None
    if world.rank == 0:
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
    path = world.comm.bcast(path, root=0)
    small = [np.full(64, float(world.rank), np.float32) for _ in range(10)]
    big = np.ones(600_000, np.float32)  # 2.4 MB: the ring on one node
    expected_big = choose_algorithm(big.nbytes, world.size, topology=comm_topology(world.comm))
    assert expected_big == ("ring" if world.size > 1 and world.num_nodes == 1 else
                            expected_big)
    with timeline.recording():
        strategy.reduce("SUM", small, axis=None)
        strategy.extended.engine.all_reduce(big, "SUM")
        strategy.gather(np.arange(world.rank + 1), axis=0)
        with timeline.span("write shard", "checkpoint", nbytes=123, file="x.h5"):
            pass
        written = timeline.flush(path, comm=world.comm)
    if world.rank != 0:
        assert written is None
        return
    assert written == path
    with open(path) as handle:
        trace = json.load(handle)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {r: f"rank {r}" for r in range(world.size)}
    for rank in range(world.size):
        mine = [e for e in events if e["pid"] == rank]
        collectives = [e for e in mine if e["cat"] == "collective"]
        assert [e["name"] for e in collectives] == ["all_reduce SUM", "all_reduce SUM",
                                                   "all_gather axis=0"]
        first, second, gather = collectives
        assert first["args"]["bytes"] == 10 * 64 * 4 and first["args"]["tensors"] == 10
        assert first["args"]["backend"] == "host-mpi"
        assert first["args"]["algorithm"] == "mpi"
        assert second["args"]["bytes"] == big.nbytes
        assert second["args"]["algorithm"] == expected_big  # by size and topology
        for e in collectives:
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["args"]["wait_us"] >= 0
            assert e["args"]["ranks"] == world.size
        # the slowest rank to arrive waited for nobody
        assert min(e["args"]["wait_us"] for e in events
                   if e["cat"] == "collective" and e["args"]["seq"] == first["args"]["seq"]) == 0
        buckets = [e for e in mine if e["cat"] == "bucket"]
        assert len(buckets) == 2  # one fused bucket, one large tensor
        span = [e for e in mine if e["cat"] == "checkpoint"]
        assert span[0]["name"] == "write shard" and span[0]["args"] == {"file": "x.h5",
                                                                        "bytes": 123}


def test_spans_cost_nothing_recorded_when_off():
    assert not timeline.ON or os.environ.get(timeline.PATH_ENV)
    with timeline.recording() as events:
        pass
    before = len(events)
    if not timeline.ON:
        with timeline.span("x", "dataset"):
            pass
        assert timeline.span("y", "dataset") is timeline.span("z", "checkpoint")
    assert len(events) == before


def test_chrome_trace_is_a_pure_merge_with_clock_offsets():
    e0 = timeline.Event("all_reduce SUM", "collective", 10.0, 10.5, 8, 1,
                        {"engine": 1, "seq": 4})
    e1 = timeline.Event("all_reduce SUM", "collective", 110.2, 110.5, 8, 7,
                        {"engine": 1, "seq": 4})
    trace = chrome_trace = timeline.chrome_trace([[e0], [e1]], [0.0, 100.0])
    x = [e for e in chrome_trace["traceEvents"] if e["ph"] == "X"]
    assert x[0]["ts"] == 0.0 and x[1]["ts"] == pytest.approx(0.2e6)
    assert x[0]["args"]["wait_us"] == pytest.approx(0.2e6) and x[1]["args"]["wait_us"] == 0
    assert x[1]["tid"] == 0 and trace["displayTimeUnit"] == "ms"


@pytest.mark.mpi(min_size=1)
def test_checkpoint_saves_restores_and_dataset_steps_are_on_the_timeline(world, strategy):
    directory = world.comm.bcast(tempfile.mkdtemp() if world.rank == 0 else None, root=0)
    path = world.comm.bcast(os.path.join(directory, "trace.json") if world.rank == 0 else None,
                            root=0)
    ckpt = ms.Checkpoint(w=ms.Variable(np.arange(1000.0)))
    dataset = ms.data.Dataset.range(12).batch(4)
    with timeline.recording():
        saved = ckpt.save(os.path.join(directory, "ckpt"))
        ckpt.restore(saved)
        steps = sum(1 for _ in strategy.experimental_distribute_dataset(dataset))
        timeline.flush(path, comm=world.comm)
    if world.rank != 0:
        return
    with open(path) as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e["ph"] == "X"]
    for rank in range(world.size):
        mine = [e for e in events if e["pid"] == rank]
        checkpoint = {e["name"]: e for e in mine if e["cat"] == "checkpoint"}
        assert checkpoint["checkpoint save"]["args"]["file"] == "ckpt-1.h5"
        assert checkpoint["checkpoint save"]["args"]["bytes"] >= 8000
        assert checkpoint["checkpoint restore"]["args"]["bytes"] >= 8000
        data = [e for e in mine if e["cat"] == "data"]
        assert [e["args"]["step"] for e in data] == list(range(steps + 1))  # + the last check


@pytest.mark.mpi(min_size=1)
def test_a_collective_is_not_charged_with_jax_compute_in_flight(world, strategy):
    """JAX dispatches asynchronously: the collective waits for its input first, and that wait
    is a slice of its own before the collective's (issue 16: a 1-rank all-reduce showed 140 ms
    where it takes 3 ms alone)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    matrix = jnp.ones((700, 700), jnp.float32) / 700
    jax.block_until_ready(matrix)

    @jax.jit
    def heavy(m):
        for _ in range(30):
            m = jnp.tanh(m @ m)
        return m

    jax.block_until_ready(heavy(matrix))   # compiled
    with timeline.recording() as events:
        result = heavy(matrix)             # still computing when the collective starts
        out = strategy.extended.engine.all_reduce(result, "SUM")
    waits = [e for e in events if e.name == "wait for JAX arrays"]
    collectives = [e for e in events if e.category == "collective"]
    assert len(waits) == 1 and len(collectives) == 1, events
    wait, collective = waits[0], collectives[0]
    assert wait.category == "compute" and wait.nbytes == result.nbytes
    assert wait.end <= collective.start                 # the wait is not inside the slice
    np.testing.assert_allclose(np.asarray(out), np.asarray(result) * world.size, rtol=1e-6)
    # nothing to wait for: NumPy inputs record no wait slice
    with timeline.recording() as events:
        strategy.extended.engine.all_reduce(np.ones(4), "SUM")
    assert [e.name for e in events if e.category == "compute"] == []
