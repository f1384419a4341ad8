"""Checkpoint pieces that need no MPI traffic: layout math, state file, object graph, names."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint.files import MARKER, data_file, missing_hint, remove_leftovers, state_name
from mpistrat.checkpoint.graph import check_path, collect_slots
from mpistrat.checkpoint.layout import partition_owner, read_runs, rows_of, write_partitions
from mpistrat.checkpoint.state_file import CheckpointState, format_state, parse_state


@pytest.mark.parametrize("shape,world", [((10, 4), 3), ((1,), 4), ((), 2), ((3000, 200), 4),
                                         ((5, 0), 3)])
def test_write_partitions_cover_rows_and_respect_the_minimum(shape, world):
    parts = write_partitions(shape, 4, world, min_partition_bytes=1024)
    assert parts[0][0] == 0 and parts[-1][1] == rows_of(shape)
    assert len(parts) <= world and all(b >= a for a, b in parts)
    row_bytes = 4 * int(np.prod(shape[1:], dtype=np.int64))
    if len(parts) > 1:
        assert all((b - a) * row_bytes >= 1024 for a, b in parts)


def test_owners_spread_small_values_over_ranks():
    owners = [partition_owner(i, 0, 4) for i in range(8)]
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sorted(partition_owner(2, p, 4) for p in range(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("parts,readers", [(4, 2), (3, 4), (1, 3), (5, 5)])
def test_read_runs_are_contiguous_and_cover_all_partitions(parts, readers):
    runs = read_runs(parts, readers)
    assert len(runs) == readers and runs[0][0] == 0 and runs[-1][1] == parts
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


def test_state_file_round_trip_and_rejects_garbage():
    state = CheckpointState('ck "2"', ["ckpt-1", 'ck "2"'], [1.5, 2.5], 0.25)
    assert parse_state(format_state(state)) == state
    with pytest.raises(ValueError, match="malformed"):
        parse_state("model_checkpoint_path = __import__('os')\n")
    with pytest.raises(ValueError, match="quoted"):
        parse_state("model_checkpoint_path: ckpt-1\n")


def test_object_paths_are_validated():
    assert check_path("model/dense/kernel") == "model/dense/kernel"
    for bad in ["../etc", "a//b", "a/ b", "x/.."]:
        with pytest.raises(ValueError, match="not allowed"):
            check_path(bad)
    with pytest.raises(ValueError):
        collect_slots({"bad name": np.zeros(1)})


def test_graph_walks_objects_containers_and_shares_once():
    class Layer:
        def __init__(self):
            self.kernel = ms.Variable(np.ones(2))
            self._hidden = np.zeros(3)        # private: not saved
            self.name = "dense"               # strings: not saved
    layer, shared = Layer(), np.arange(3.0)
    slots = collect_slots({"model": {"layers": [layer], "a": shared, "b": shared}, "lr": 0.1})
    assert sorted(slots) == ["lr", "model/a", "model/layers/0/kernel"]
    assert slots["model/layers/0/kernel"].kind == "variable" and slots["lr"].kind == "float"


def test_file_names_and_hints(tmp_path):
    assert data_file(str(tmp_path / "ckpt-3")) == str(tmp_path / "ckpt-3.h5")
    (tmp_path / "ckpt-3.h5").write_bytes(b"x")
    assert "e.g. " + str(tmp_path / "ckpt-3") in missing_hint(str(tmp_path / "ckpt"))
    assert missing_hint(str(tmp_path / "ckpt-4")) == ""


def test_cleanup_removes_only_our_marked_files(tmp_path):
    token, other = "a" * 32, "b" * 32
    ours = [f".ckpt-4.h5.tmp-{token}", f"ckpt-4.part-0-of-2-{token}.h5"]   # torn save, no master
    foreign = [".bashrc.tmp-1", ".other_job_ckpt-9.h5.tmp-deadbeef", "results.part-0-of-4.h5",
               f".notes.txt.tmp-{other}",                                   # our pattern, no marker
               f"ckpt-5.part-0-of-2-{other}.h5"]                            # no marker
    for name in ours:
        (tmp_path / name).write_bytes(MARKER + b"\0" * 100)
    for name in foreign:
        (tmp_path / name).write_bytes(b"someone else's data")
    assert sorted(remove_leftovers(str(tmp_path))) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(foreign)
    for name in foreign:
        assert (tmp_path / name).read_bytes() == b"someone else's data"


def test_state_names_stay_inside_the_directory(tmp_path):
    d = str(tmp_path)
    assert state_name(d, "ckpt-3") == "ckpt-3"
    assert state_name(d, str(tmp_path / "ckpt-3")) == "ckpt-3"        # absolute, but inside
    for bad in ["../outside/x", "/etc/passwd", "../victim/data.h5", "sub/ckpt-1", "..", ".",
                "", "a\x00b", str(tmp_path.parent / "x")]:
        assert state_name(d, bad) is None, bad
