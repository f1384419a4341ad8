"""The tuning table's pure logic: buckets, the pick, and the file as hostile input."""

import json

import pytest

from mpistrat.collectives import tuning
from mpistrat.collectives.tuning import TuningFileError, TuningTable

KEY = tuning.table_key("Open MPI v4.1", 2, 1, 2, host="x86_64 test cpu")


def _table():
    return TuningTable(dict(KEY), {(4, 4 << 20, "out"): "ring", (8, 4 << 20, "out"): "rabenseifner",
                                   (4, 4096, "out"): "mpi", (4, 4 << 20, "in"): "mpi"},
                       "calibrated", {(4, 4 << 20, "out"): {"mpi": 2.0, "ring": 1.0},
                                      (4, 4 << 20, "in"): {"mpi": 0.5, "ring": 1.0}}, 1.25)


def test_buckets_are_powers_of_four_from_4kib_to_64mib_and_sizes_take_the_nearest():
    assert tuning.BUCKETS[0] == 4096 and tuning.BUCKETS[-1] == 64 << 20
    assert all(b * 4 == c for b, c in zip(tuning.BUCKETS, tuning.BUCKETS[1:]))
    assert tuning.bucket_of(2047) is None and tuning.bucket_of(2048) == 4096
    assert tuning.bucket_of(3 << 20) == 4 << 20 and tuning.bucket_of(1 << 20) == 1 << 20
    assert tuning.bucket_of(10 << 30) == 64 << 20
    assert tuning.size_class(2) == 4 and tuning.size_class(4) == 4 and tuning.size_class(8) == 8


def test_pick_keeps_mpi_unless_clearly_beaten_and_breaks_ties_in_candidate_order():
    assert tuning.pick({"mpi": 1.0, "ring": 0.5, "rabenseifner": 0.7}) == "ring"
    assert tuning.pick({"mpi": 1.0, "ring": 0.96}) == "mpi"
    assert tuning.pick({"mpi": 1.0, "ring": 0.5, "rabenseifner": 0.5}) == "ring"
    assert tuning.pick({"mpi": float("nan"), "ring": 2.0}) == "ring"
    assert tuning.pick({}) == "mpi"


def test_table_chooses_per_class_and_bucket_and_leaves_the_rest_to_the_rules():
    table = _table()
    assert table.choose(4 << 20, 4) == "ring" and table.choose(4 << 20, 2) == "ring"
    assert table.choose(5 << 20, 8) == "rabenseifner"
    assert table.choose(64 << 20, 4) is None and table.choose(100, 4) is None
    # in place is another entry: MPI's own there, where the ring wins out of place
    assert table.choose(4 << 20, 4, in_place=True) == "mpi"
    assert table.choose(5 << 20, 8, in_place=True) is None
    assert tuning.key_of(4 << 20, 2, in_place=True) == (4, 4 << 20, "in")
    assert tuning.key_of(1000, 4) is None


def test_a_saved_table_reads_back_and_other_keys_are_kept(tmp_path):
    path = str(tmp_path / "tuning.json")
    tuning.save_table(path, _table())
    other = TuningTable(dict(KEY, size=4, ranks_per_node=4), {(4, 16384, "in"): "ring"}, "x")
    tuning.save_table(path, other)
    back = tuning.load_table(path, KEY)
    assert back.choices == _table().choices and back.source == f"file {path}"
    assert back.times[(4, 4 << 20, "out")] == {"mpi": 2.0, "ring": 1.0}
    assert back.times[(4, 4 << 20, "in")] == {"mpi": 0.5, "ring": 1.0}
    assert tuning.load_table(path, other.key).choices == other.choices
    assert len(json.loads(open(path).read())["tables"]) == 2


def _doc(**change):
    doc = {"format": tuning.FORMAT, "version": tuning.VERSION, "buckets": list(tuning.BUCKETS),
           "tables": [_table().to_json()]}
    doc.update(change)
    return json.dumps(doc)


@pytest.mark.parametrize("text, word", [
    ("{not json", "corrupt"), ("[1, 2]", "corrupt"), (_doc(format="other"), "corrupt"),
    (_doc(version=0), "stale"), (_doc(version=1), "stale"), (_doc(buckets=[1, 2]), "stale"),
    (_doc(tables="x"), "corrupt"), (_doc(tables=[{"key": dict(KEY, host="elsewhere"),
                                                  "entries": []}]), "foreign"),
    (_doc(tables=[{"key": dict(KEY), "entries": [{"class": 4, "bytes": 4096, "place": "in",
                                                  "algorithm": "rm -rf"}]}]), "corrupt"),
    (_doc(tables=[{"key": dict(KEY), "entries": [{"class": 3, "bytes": 4096, "place": "in",
                                                  "algorithm": "ring"}]}]), "corrupt"),
    (_doc(tables=[{"key": dict(KEY), "entries": [{"class": 4, "bytes": 4096, "place": "in",
                                                  "algorithm": "ring",
                                                  "times": {"ring": "fast"}}]}]), "corrupt"),
    # a version 1 entry (no place), another place, an entry given twice
    (_doc(tables=[{"key": dict(KEY), "entries": [{"class": 4, "bytes": 4096,
                                                  "algorithm": "ring"}]}]), "corrupt"),
    (_doc(tables=[{"key": dict(KEY), "entries": [{"class": 4, "bytes": 4096, "place": "gpu",
                                                  "algorithm": "ring"}]}]), "corrupt"),
    (_doc(tables=[{"key": dict(KEY), "entries": [{"class": 4, "bytes": 4096, "place": "in",
                                                  "algorithm": "ring"}] * 2}]), "corrupt"),
    (_doc(tables=[{"key": dict(KEY), "entries": [{}] * 100}]), "corrupt"),
])
def test_a_corrupt_foreign_or_stale_file_is_refused_naming_the_file_and_why(text, word):
    with pytest.raises(TuningFileError, match=rf"^/some/tuning.json: {word}"):
        tuning.parse_file(text, KEY, "/some/tuning.json")


def test_an_oversized_or_binary_file_is_refused_unparsed(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (tuning.MAX_FILE_BYTES + 1))
    with pytest.raises(TuningFileError, match="corrupt"):
        tuning.load_table(str(big), KEY)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TuningFileError, match="not UTF-8"):
        tuning.load_table(str(binary), KEY)


def test_hierarchical_is_a_candidate_only_across_nodes_of_several_ranks():
    from mpistrat.collectives.calibration import candidates_for
    from mpistrat.collectives.topology import make_topology, single_node
    assert candidates_for(single_node(4)) == ("mpi", "ring", "rabenseifner")
    assert candidates_for(make_topology([0, 1], [None] * 2)) == ("mpi", "ring", "rabenseifner")
    assert "hierarchical" in candidates_for(make_topology([0, 0, 1, 1], [None] * 4))


def test_info_renders_the_table_and_its_source():
    from mpistrat.__main__ import render_tuning
    lines = render_tuning({"source": "file /x.json", "entries": _table().rows()})
    assert lines[1] == "tuning table: file /x.json"
    assert any("4 MiB" in line and "separate" in line and "ring" in line and
               "mpi 2000000 us" in line for line in lines)
    assert any("4 MiB" in line and "in place" in line and "mpi 500000 us" in line
               for line in lines)


def test_info_shows_the_real_means_of_a_refined_bucket():
    from mpistrat.__main__ import render_tuning
    table = _table()
    table.online[(4, 4 << 20, "out")] = {"mpi": 0.003, "ring": 0.004}
    lines = render_tuning({"source": "calibrated", "entries": table.rows()})
    assert any("4 MiB" in line and "in real calls: mpi 3000 us, ring 4000 us" in line
               for line in lines)
    assert all("online" not in row for row in table.to_json()["entries"])


def test_a_trial_tries_only_algorithms_calibrated_near_the_choice():
    from mpistrat.collectives.refinement import BucketTrial
    trial = BucketTrial("mpi", {"mpi": 1.0, "ring": 1.4, "rabenseifner": 1.6}, calls=1)
    assert trial.queue == ["ring"] and not trial.settled
    assert trial.record(0.5) and trial.decide(0.5) == "ring"
    assert trial.record(0.48) and trial.decide(0.48) == "mpi"   # not 5% better: MPI's own
    assert trial.settled and trial.measured == {"mpi": 0.5, "ring": 0.48}
    assert BucketTrial("ring", {}, calls=4).settled   # nothing calibrated: nothing to try
