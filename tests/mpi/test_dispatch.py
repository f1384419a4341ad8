"""The all-reduce's one table of ops (collectives/allreduce_ops.py): which op takes which call,
and ranks whose calls would take different paths (an algorithm, a bucket size or reproducible
sums asked for on some ranks only) raise together, naming each rank's path, instead of pairing
different MPI calls (a hang, or sums of misaligned buckets)."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.collectives import CollectiveEngine
from mpistrat.errors import InvalidArgumentError


@pytest.mark.mpi(min_size=1)
def test_each_call_takes_the_first_op_of_the_table_that_is_enabled(world):
    engine = CollectiveEngine(world.comm)
    several = world.size > 1
    probe = "validation-probe" if several else "host-mpi algorithm=auto pack=4194304"
    assert engine.path_of(1.0, "SUM") == probe               # a loss rides in the probe
    assert engine.path_of(np.ones(10, np.float32), "MEAN") == probe
    assert engine.path_of(np.ones(11), "SUM") == "host-mpi algorithm=auto pack=4194304"
    assert engine.path_of(1.0, "MAX") == "host-mpi algorithm=auto pack=4194304"
    assert engine.path_of(np.ones(3), "SUM", ms.CommunicationOptions(deterministic=True)) == \
        "reproducible algorithm=auto pack=4194304"
    ring = ms.CommunicationOptions(algorithm="ring", bytes_per_pack=1 << 20)
    assert engine.path_of([np.ones(100)], "SUM", ring) == "host-mpi algorithm=ring pack=1048576"


_DETERMINISTIC = ms.CommunicationOptions(deterministic=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("base,last,names", [
    (None, ms.CommunicationOptions(algorithm="ring"), "algorithm=ring"),
    (None, ms.CommunicationOptions(bytes_per_pack=4096), "pack=4096"),
    (None, _DETERMINISTIC, "via reproducible"),
    (_DETERMINISTIC, ms.CommunicationOptions(deterministic=True, algorithm="ring"),
     "via reproducible algorithm=ring"),
], ids=["algorithm", "bucket size", "reproducible", "reproducible's algorithm"])
def test_ranks_whose_calls_take_different_paths_raise_together(world, base, last, names):
    engine = CollectiveEngine(world.comm)
    grads = [np.full(3000, world.rank + 1.0), np.ones(200, np.float32)]   # (no fold)
    mine = last if world.rank == world.size - 1 else base
    with pytest.raises(InvalidArgumentError, match="different collectives") as caught:
        engine.all_reduce(grads, "SUM", mine)
    text = str(caught.value)
    assert names in text and f"rank {world.size - 1} calls all_reduce SUM via" in text, text
    assert "rank 0 calls all_reduce SUM via " + engine.path_of(grads, "SUM", base) in text
    # nothing travelled and the engine is still usable, with the same options everywhere
    total = engine.all_reduce(grads, "SUM", last)
    np.testing.assert_array_equal(total[0], np.full(3000, sum(range(1, world.size + 1))))
    assert engine.all_reduce(1.0, "SUM") == world.size


@pytest.mark.mpi(min_size=2)
def test_the_timeline_and_the_trace_do_not_change_the_path(world, monkeypatch):
    """A rank that records a timeline meets one that does not, on every op: the table's
    choice depends on the call alone."""
    from mpistrat.runtime import timeline
    engine = CollectiveEngine(world.comm)
    values = [1.0, np.float32(2.5), np.arange(4.0), [np.ones(3000)],
              {"a": np.ones(5, np.int32), "b": np.ones(2000)}]
    if world.rank == 0:
        monkeypatch.setattr(timeline, "ON", True)
        monkeypatch.setattr(timeline, "begin", lambda value: 0.0)
        seen = []
        monkeypatch.setattr(timeline, "end", lambda what, start, nbytes, args:
                            seen.append(args["backend"]))
    for value in values:
        out = engine.all_reduce(value, "SUM")
        want = ms.nest.map_structure(lambda v: np.asarray(v) * world.size, value) \
            if not isinstance(value, (float, np.floating)) else value * world.size
        for got, expected in zip(ms.nest.flatten(out), ms.nest.flatten(want)):
            np.testing.assert_array_equal(got, expected)
    if world.rank == 0:
        assert seen == ["validation-probe", "validation-probe", "validation-probe",
                        "host-mpi", "host-mpi"], seen
