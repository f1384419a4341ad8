"""The tuner at 1-4 ranks: agreed choices, the tuning file as hostile input, the cache, and
the same sums whichever algorithm the table forces."""

import os
import stat

import numpy as np
import pytest

from mpistrat.collectives import calibration, tuning
from mpistrat.collectives.engine import CollectiveEngine
from mpistrat.collectives.options import CommunicationOptions

pytestmark = pytest.mark.numpy_only("host-buffer algorithms and raw MPI comparisons")


@pytest.fixture
def comm(world):
    """A fresh duplicate of the world: nothing cached on it yet."""
    dup = world.comm.Dup()
    yield dup
    dup.Free()


@pytest.fixture
def shared_path(world, tmp_path):
    """One file path, rank 0's, on every rank (the ranks share this host's /tmp)."""
    return world.comm.bcast(str(tmp_path / "tuning.json"), root=0)


def _fake(rank_of_liar):
    """Timings where one rank sees the ring fastest and every other rank MPI's own."""
    def measure(comm, name, cls, nbytes, in_place):
        liar = comm.Get_rank() == rank_of_liar
        return {"mpi": 1.0 if liar else 0.1, "ring": 0.1 if liar else 0.5,
                "rabenseifner": 0.9, "hierarchical": 2.0}[name] * nbytes * 1e-9
    return measure


def test_one_rank_fed_other_timings_still_yields_the_agreed_choice_on_every_rank(comm):
    liar = comm.Get_size() - 1
    table = calibration.calibrate(comm, budget=1e9, measure=_fake(liar))
    everyone = comm.allgather(sorted(table.choices.items()))
    assert all(choices == everyone[0] for choices in everyone)
    # the MAX of every rank's timings: MPI's own 1.0 (the liar's), the ring 0.5 (the others'):
    # the ring everywhere, although most ranks alone would have kept MPI's own
    assert set(table.choices.values()) == {"ring"}
    assert len(table.choices) == len(tuning.BUCKETS) * len(tuning.SIZE_CLASSES) * 2
    assert {place for _, _, place in table.choices} == set(tuning.PLACES)


def test_the_budget_stops_every_rank_at_the_same_bucket_when_one_rank_is_slow(comm):
    import time

    def measure(c, name, cls, nbytes, in_place):
        if c.Get_rank() == 0:
            time.sleep(0.01)
        return 1e-6
    table = calibration.calibrate(comm, budget=0.25, measure=measure)
    counts = comm.allgather(len(table.choices))
    assert len(set(counts)) == 1 and 0 < counts[0] < len(tuning.BUCKETS) * 4


def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning_and_replaced(comm, shared_path,
                                                                         monkeypatch):
    monkeypatch.setenv("MPISTRAT_TUNING_FILE", shared_path)
    monkeypatch.setenv("MPISTRAT_TUNING_BUDGET", "0.3")
    for text in ("{corrupt", '{"format": "mpistrat-tuning", "version": %d, "buckets": %s, '
                             '"tables": [{"key": {"host": "elsewhere"}, "entries": []}]}'
                 % (tuning.VERSION, list(tuning.BUCKETS))):
        if comm.Get_rank() == 0:
            with open(shared_path, "w") as f:
                f.write(text)
        comm.Barrier()
        calibration.forget(comm)
        if comm.Get_size() == 1:
            assert calibration.table_for(comm) is None   # one rank: nothing to tune
            continue
        with pytest.warns(UserWarning, match="ignoring tuning file: .*(corrupt|foreign)"):
            table = calibration.table_for(comm)
        assert table is not None and table.source.startswith("calibrated")
        comm.Barrier()
        # the calibration replaced it with a valid table for this key
        assert tuning.load_table(shared_path, table.key).choices == table.choices
        comm.Barrier()   # every rank has read it before rank 0 writes the next text


def _make_special(path, kind):
    """A FIFO (mkfifo), a character device like /dev/null (mknod), 200 KB of '[', or a
    shared 0644 tuning file."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))   # /dev/null's numbers
    elif kind == "brackets":
        with open(path, "w") as f:
            f.write("[" * 200_000)
    else:
        with open(path, "w") as f:
            f.write("{corrupt")
        os.chmod(path, 0o644)


@pytest.mark.parametrize("kind", ["fifo", "device", "brackets", "shared 0644"])
def test_a_hostile_tuning_path_neither_hangs_nor_is_replaced(comm, shared_path, monkeypatch, kind):
    """Before: a FIFO held rank 0 forever, nested brackets raised RecursionError on rank 0 while
    the others waited, a device node was replaced by a regular file, a 0644 file became 0600."""
    if comm.Get_size() == 1:
        pytest.skip("one rank: nothing to tune")
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    monkeypatch.setenv("MPISTRAT_TUNING_FILE", shared_path)
    monkeypatch.setenv("MPISTRAT_TUNING_BUDGET", "0.3")
    if comm.Get_rank() == 0:
        _make_special(shared_path, kind)
    comm.Barrier()
    calibration.forget(comm)
    with pytest.warns(UserWarning) as caught:
        table = calibration.table_for(comm)    # within pytest's timeout: no hang
    assert table is not None and table.source.startswith("calibrated")
    texts = " ".join(str(w.message) for w in caught)
    comm.Barrier()
    info = os.lstat(shared_path)
    if kind in ("fifo", "device"):   # left as it was, and the warning says why
        assert "not a regular file" in texts, texts
        assert stat.S_ISFIFO(info.st_mode) if kind == "fifo" else stat.S_ISCHR(info.st_mode)
    else:
        assert "ignoring tuning file" in texts, texts
        assert stat.S_ISREG(info.st_mode)
        if kind == "shared 0644":
            assert stat.S_IMODE(info.st_mode) == 0o644
        assert tuning.load_table(shared_path, table.key).choices == table.choices
    comm.Barrier()


def test_the_second_run_uses_the_cached_table_without_calibrating(comm, shared_path,
                                                                   monkeypatch):
    monkeypatch.setenv("MPISTRAT_TUNING_FILE", shared_path)
    monkeypatch.setenv("MPISTRAT_TUNING_BUDGET", "0.3")
    if comm.Get_rank() == 0 and os.path.exists(shared_path):
        os.unlink(shared_path)
    comm.Barrier()
    first = calibration.table_for(comm)
    if comm.Get_size() == 1:
        assert first is None
        return
    assert first.source.startswith("calibrated") and shared_path in first.source
    second_comm = comm.Dup()
    try:
        def refuse(*args, **kwargs):
            raise AssertionError("calibrated again although the file holds this job's table")
        monkeypatch.setattr(calibration, "calibrate", refuse)
        second = calibration.table_for(second_comm)
        assert second.source == f"file {shared_path}" and second.choices == first.choices
        assert first.refine_calls == second.refine_calls == 64   # MPISTRAT_TUNING_REFINE
        assert calibration.describe(second_comm)["source"] == second.source
    finally:
        second_comm.Free()


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "rabenseifner", "hierarchical"])
def test_forcing_each_algorithm_through_the_table_gives_the_same_sums(comm, algorithm):
    every = {(c, b, p): algorithm for c in tuning.SIZE_CLASSES for b in tuning.BUCKETS
             for p in tuning.PLACES}
    calibration.install(comm, tuning.TuningTable({}, every, "test"))
    engine = CollectiveEngine(comm)
    rng = np.random.default_rng(comm.Get_rank())
    for dtype in (np.float32, np.float64, np.int64):
        for count in (600, 5000, 300_001):
            value = rng.integers(-50, 50, count).astype(dtype)   # exact in any order
            expected = np.empty_like(value)
            comm.Allreduce(value, expected)
            got = engine.all_reduce(value, "SUM")
            assert got.dtype == expected.dtype
            np.testing.assert_array_equal(got, expected, err_msg=f"{algorithm} {dtype} {count}")
            # many tensors: fused buckets follow the table too
            pair = engine.all_reduce([value, value[: count // 3]], "SUM")
            np.testing.assert_array_equal(pair[0], expected)
            np.testing.assert_array_equal(pair[1], expected[: count // 3])
    # and the per-call preference still wins over the table
    forced = engine.all_reduce(np.ones(1 << 16), "SUM",
                               CommunicationOptions(algorithm="reduce_broadcast"))
    np.testing.assert_array_equal(forced, np.full(1 << 16, float(comm.Get_size())))


@pytest.mark.parametrize("apart, in_place", [("ring", "mpi"), ("mpi", "ring")])
def test_a_fused_bucket_takes_the_in_place_entry_and_a_lone_tensor_the_other(comm, apart,
                                                                             in_place):
    """A fused bucket is reduced over itself, a tensor the caller keeps into a new buffer:
    each follows the table's entry for its place (what ran is recorded: our schedule's
    steps, or MPI's own call), and the sums are the same either way."""
    from mpistrat.collectives import algorithms
    table = {(c, b, p): apart if p == "out" else in_place for c in tuning.SIZE_CLASSES
             for b in tuning.BUCKETS for p in tuning.PLACES}
    calibration.install(comm, tuning.TuningTable({}, table, "test"))
    engine = CollectiveEngine(comm)
    lone = np.arange(1 << 16, dtype=np.float32) + comm.Get_rank()        # 256 KiB, kept
    small = [np.full(2048, float(i + comm.Get_rank()), np.float32) for i in range(8)]
    expected = np.empty_like(lone)
    comm.Allreduce(lone, expected)
    for value, place in ((lone, apart), (small, in_place)):
        with algorithms.recording() as events:
            got = engine.all_reduce(value, "SUM")
        if comm.Get_size() == 1:
            continue
        kinds = {event[0] for event in events}
        assert kinds == ({"call"} if place == "mpi" else {"step"}), (place, events[:3])
    np.testing.assert_array_equal(engine.all_reduce(lone, "SUM"), expected)
    n = comm.Get_size()
    for i, total in enumerate(engine.all_reduce(small, "SUM")):
        np.testing.assert_array_equal(total, np.full(2048, n * i + n * (n - 1) / 2, np.float32))


# -- online refinement (collectives/refinement.py) ----------------------------------------
from mpistrat.collectives import refinement  # noqa: E402


@pytest.mark.parametrize("timed", [False, True])
def test_real_calls_refine_a_bucket_to_one_choice_on_every_rank(comm, timed):
    """A table whose 64 KiB float32 choice is the ring, with MPI's own calibrated close and
    rabenseifner far: 3 real calls of the ring, 3 of MPI's own, then the faster of their
    agreed real means everywhere, rabenseifner never tried; every sum stays exact."""
    key = (4, 1 << 16, "out")
    table = tuning.TuningTable({}, {key: "ring"}, "test",
                               {key: {"mpi": 1.0, "ring": 0.9, "rabenseifner": 5.0}})
    table.refine_calls = 3
    calibration.install(comm, table)
    engine = CollectiveEngine(comm)
    options = CommunicationOptions(timeout_seconds=60.0) if timed else None
    value = np.arange(1 << 14, dtype=np.float32) + comm.Get_rank()
    expected = np.empty_like(value)
    comm.Allreduce(value, expected)
    for call in range(8):
        np.testing.assert_array_equal(engine.all_reduce(value, "SUM", options), expected)
        if comm.Get_size() > 1 and call == 2:   # the ring's trial is over: MPI's own runs
            assert table.trials[key].current == "mpi" and not table.trials[key].settled
    if comm.Get_size() == 1:
        assert not table.trials   # one rank: nothing to tune, nothing timed
        return
    trial = table.trials[key]
    assert trial.settled and set(trial.measured) == {"ring", "mpi"}
    assert table.online[key] == trial.measured and table.choices[key] == trial.current
    everyone = comm.allgather((table.choices[key], table.online[key]))
    assert all(entry == everyone[0] for entry in everyone)   # the same choice and means
    row = [r for r in table.rows() if (r["class"], r["bytes"], r["place"]) == key][0]
    assert row["online"] == {n: round(t, 9) for n, t in trial.measured.items()}
    assert "online" not in table.to_json()["entries"][0]     # the file keeps calibrations


def test_refinement_agrees_when_ranks_time_differently(comm):
    """Each rank feeds its own real timings (rank 0 sees MPI's own slow, the others fast):
    the MAX agreement gives every rank the same means and the same choice."""
    rank = comm.Get_rank()
    trial = refinement.BucketTrial("mpi", {"mpi": 1.0, "ring": 1.2}, calls=2)
    for algorithm, mine in (("mpi", 3.0 if rank == 0 else 1.0), ("ring", 2.0)):
        assert trial.current == algorithm
        assert [trial.record(mine), trial.record(mine)] == [False, True]
        trial.decide(refinement._agreed_max(comm, trial.mean(), None))
    everyone = comm.allgather((trial.current, trial.measured))
    assert all(entry == everyone[0] for entry in everyone)
    assert trial.settled and trial.current == "ring"   # 2.0 beats MPI's own agreed 3.0
    assert trial.measured == {"mpi": 3.0, "ring": 2.0}


def test_refinement_off_keeps_the_calibrated_choice(comm):
    key = (4, 1 << 16, "out")
    table = tuning.TuningTable({}, {key: "ring"}, "test", {key: {"mpi": 1.0, "ring": 0.9}})
    calibration.install(comm, table)      # refine_calls 0: off
    engine = CollectiveEngine(comm)
    for _ in range(4):
        engine.all_reduce(np.ones(1 << 14, np.float32), "SUM")
    assert table.choices[key] == "ring" and not table.trials and not table.online


def test_without_a_table_a_fused_bucket_takes_mpi_own_and_a_kept_tensor_the_ring(comm):
    """The static rules (no table) by place: in place on one node MPI's own below
    ``IN_PLACE_RING_THRESHOLD_BYTES``, out of place the ring from ``RING_THRESHOLD_BYTES``."""
    from mpistrat.collectives import algorithms
    assert algorithms.RING_THRESHOLD_BYTES <= 2 << 20 < 4 << 20 < \
        algorithms.IN_PLACE_RING_THRESHOLD_BYTES
    calibration.install(comm, None)
    engine = CollectiveEngine(comm)
    lone = np.ones(1 << 19, np.float32)                                 # 2 MiB, kept
    small = [np.full(1 << 14, 1.0, np.float32) for _ in range(40)]      # one 2.5 MiB bucket
    for value, expected in ((lone, "step"), (small, "call")):
        with algorithms.recording() as events:
            totals = engine.all_reduce(value, "SUM")
        for total in (totals if isinstance(totals, list) else [totals]):
            np.testing.assert_array_equal(total, np.full(total.shape, comm.Get_size(),
                                                         np.float32))
        if comm.Get_size() > 1 and topology_is_one_node(comm):
            assert {event[0] for event in events} == {expected}, events[:3]


def topology_is_one_node(comm) -> bool:
    from mpistrat.collectives.topology import comm_topology
    return comm_topology(comm).num_nodes == 1
