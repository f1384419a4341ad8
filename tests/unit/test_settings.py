"""The one parser of every MPISTRAT_* variable: accepted and refused values, and the rule that
every variable is read through it, registered, and documented in docs/settings.md."""

import re
from pathlib import Path

import pytest

from mpistrat.runtime import settings
from mpistrat.runtime.settings import SettingError

ROOT = Path(__file__).resolve().parents[2]


def value(name, text):
    return settings.get(name, {name: text})


@pytest.mark.parametrize("name,text", [
    ("MPISTRAT_COLLECTIVE_TIMEOUT", "abc"), ("MPISTRAT_COLLECTIVE_TIMEOUT", "0"),
    ("MPISTRAT_COLLECTIVE_TIMEOUT", "-1"), ("MPISTRAT_COLLECTIVE_TIMEOUT", "nan"),
    ("MPISTRAT_COLLECTIVE_TIMEOUT", "inf"), ("MPISTRAT_BUFFER_POOL_BYTES", "1.5MiB"),
    ("MPISTRAT_BUFFER_POOL_BYTES", "-1"), ("MPISTRAT_BUFFER_POOL_BYTES", "1 parsec"),
    ("MPISTRAT_BUFFER_POOL_BYTES", "off"), ("MPISTRAT_DETERMINISTIC", "2"),
    ("MPISTRAT_VALIDATE", "maybe"), ("MPISTRAT_ABORT_ON_ERROR", "nope"),
    ("MPISTRAT_TRACE", "verbose"), ("MPISTRAT_RANKS_PER_NODE", "0"),
    ("MPISTRAT_RANKS_PER_NODE", "two"), ("MPISTRAT_CHECKPOINT_MODE", "shared"),
    ("MPISTRAT_CUDA_AWARE_MPI", "auto"), ("MPISTRAT_NCCL", "2"),
    ("MPISTRAT_JAX_COORDINATOR", "host"), ("MPISTRAT_JAX_COORDINATOR", "host:99999"),
    ("MPISTRAT_JAX_INIT_TIMEOUT", "0"), ("MPISTRAT_COORDINATOR_HOST", "a b"),
    ("MPISTRAT_TEST_FAULT", "point:x:1"), ("MPISTRAT_TEST_FAULT", "point:0:0"),
    ("MPISTRAT_TEST_ARRAYS", "torch"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(name, text):
    with pytest.raises(ValueError) as caught:
        value(name, text)
    message = str(caught.value)
    assert isinstance(caught.value, SettingError)
    assert f"{name}={text!r}: expected " in message, message
    assert "docs/settings.md" in message
    assert settings.problems({name: text}) == [message.split(" (docs/settings.md")[0]]


@pytest.mark.parametrize("name,text,expected", [
    ("MPISTRAT_COLLECTIVE_TIMEOUT", "600", 600.0), ("MPISTRAT_COLLECTIVE_TIMEOUT", " 2.5 ", 2.5),
    ("MPISTRAT_COLLECTIVE_TIMEOUT", "1e3", 1000.0), ("MPISTRAT_COLLECTIVE_TIMEOUT", "", None),
    ("MPISTRAT_BUFFER_POOL_BYTES", "1048576", 1 << 20),
    ("MPISTRAT_BUFFER_POOL_BYTES", "0", 0), ("MPISTRAT_BUFFER_POOL_BYTES", "1GiB", 1 << 30),
    ("MPISTRAT_BUFFER_POOL_BYTES", "100 MB", 10 ** 8),
    ("MPISTRAT_BUFFER_POOL_BYTES", "64kib", 65536),
    ("MPISTRAT_BUFFER_POOL_BYTES", "16MiB", 16 << 20),
    ("MPISTRAT_DETERMINISTIC", "1", True), ("MPISTRAT_DETERMINISTIC", "TRUE", True),
    ("MPISTRAT_VALIDATE", "off", False), ("MPISTRAT_VALIDATE", "No", False),
    ("MPISTRAT_VALIDATE", "", True), ("MPISTRAT_CUDA_AWARE_MPI", "0", False),
    ("MPISTRAT_NCCL", "1", True), ("MPISTRAT_RANKS_PER_NODE", "2", 2),
    ("MPISTRAT_CHECKPOINT_MODE", "Parts", "parts"), ("MPISTRAT_JAX_COORDINATOR", "10.0.0.1:1234",
                                                     "10.0.0.1:1234"),
    ("MPISTRAT_TEST_FAULT", "checkpoint-partition-written:1:2",
     ("checkpoint-partition-written", 1, 2, "KILL")),
    ("MPISTRAT_TEST_FAULT", "checkpoint-before-checksums:1:1:stop",
     ("checkpoint-before-checksums", 1, 1, "STOP")),
])
def test_accepted_values_parse_to_their_meaning(name, text, expected):
    assert value(name, text) == expected


def test_unset_gives_the_default():
    assert settings.get("MPISTRAT_BUFFER_POOL_BYTES", {}) is None   # (1/32 of memory, <= 1 GiB)
    assert settings.get("MPISTRAT_TUNING", {}) == "auto"
    assert settings.get("MPISTRAT_VALIDATE", {}) is True
    assert settings.get("MPISTRAT_COLLECTIVE_TIMEOUT", {}) is None


def test_problems_lists_every_bad_variable_and_unknown_names_suggest_the_closest():
    env = {"MPISTRAT_VALIDATE": "maybe", "MPISTRAT_COLLECTIVE_TIMEOUT": "-1",
           "MPISTRAT_TRACE": "1", "MPISTRAT_COLECTIVE_TIMEOUT": "5", "PATH": "/bin"}
    found = settings.problems(env)
    assert len(found) == 2 and any("MPISTRAT_VALIDATE='maybe'" in p for p in found)
    assert settings.unknown_names(env) == [
        "MPISTRAT_COLECTIVE_TIMEOUT (did you mean MPISTRAT_COLLECTIVE_TIMEOUT?)"]


def test_an_import_time_read_in_a_single_process_raises_at_once(monkeypatch):
    monkeypatch.setenv("MPISTRAT_BUFFER_POOL_BYTES", "-1")
    with pytest.raises(SettingError, match="MPISTRAT_BUFFER_POOL_BYTES='-1'"):
        settings.get("MPISTRAT_BUFFER_POOL_BYTES", at_import=True)


def _sources():
    for folder in ("mpistrat", "tests", "scripts", "slurm", "jobs", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".sbatch") \
                    and "__pycache__" not in path.parts:
                yield path


def test_every_variable_the_project_names_is_registered_and_documented():
    named = set()
    for path in _sources():
        text = path.read_text(errors="replace")
        named |= set(re.findall(r"\bMPISTRAT_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))
    registered = {s.name for s in settings.SETTINGS}
    named -= {"MPISTRAT_COLECTIVE_TIMEOUT"}   # this file's example of a typo
    named -= set(settings.REMOVED)            # named only to say they are no longer read
    assert named - registered == set(), "register these in mpistrat/runtime/settings.py"
    documented = set(re.findall(r"^\| `(MPISTRAT_[A-Z0-9_]+)`",
                                (ROOT / "docs" / "settings.md").read_text(), re.M))
    assert registered - documented == set(), "add these rows to docs/settings.md"
    assert documented - registered == set(), "docs/settings.md names variables no one reads"


def test_the_library_reads_mpistrat_variables_only_through_the_parser():
    direct = []
    for path in sorted((ROOT / "mpistrat").rglob("*.py")):
        if path.name == "settings.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ(\.get\(|\[)\s*['\"]MPISTRAT_|getenv\(\s*['\"]MPISTRAT_", line):
                direct.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not direct, "read these through mpistrat.runtime.settings.get:\n" + "\n".join(direct)


def test_a_removed_variable_is_named_with_what_replaces_it():
    """MPISTRAT_RING_THRESHOLD and MPISTRAT_HIERARCHICAL_THRESHOLD only chose a path for
    benchmarking; set now, they are named as no longer read, with what to use instead."""
    found = settings.unknown_names({"MPISTRAT_RING_THRESHOLD": "4MiB",
                                    "MPISTRAT_HIERARCHICAL_THRESHOLD": "1MiB"})
    assert len(found) == 2 and all("no longer read" in text and "algorithm=" in text
                                   for text in found), found
    assert settings.problems({"MPISTRAT_RING_THRESHOLD": "4MiB"}) == []


def test_ranks_that_differ_on_a_path_setting_are_named():
    """Settings that steer which MPI calls run (uniform) must match on every rank: the
    differences are named, rank by rank, and the others may differ."""
    uniform = [s.name for s in settings.SETTINGS if s.uniform]
    assert {"MPISTRAT_VALIDATE", "MPISTRAT_DETERMINISTIC", "MPISTRAT_COLLECTIVE_TIMEOUT",
            "MPISTRAT_DISABLE_GPU"} <= set(uniform)
    assert "MPISTRAT_TRACE" not in uniform and "MPISTRAT_TIMELINE" not in uniform
    ranks = [settings.uniform_values(env) for env in (
        {}, {"MPISTRAT_VALIDATE": "0"}, {"MPISTRAT_VALIDATE": "off", "MPISTRAT_TRACE": "1"})]
    assert settings.disagreements(ranks) == [
        "MPISTRAT_VALIDATE differs between ranks: rank 0 has True; ranks 1, 2 have False"]
    assert settings.disagreements(ranks[1:]) == []
    # a timeout steers the calls by being set at all: 600 s and 900 s agree, unset does not
    timed = [settings.uniform_values({"MPISTRAT_COLLECTIVE_TIMEOUT": t}) for t in ("600", "900")]
    assert settings.disagreements(timed) == []
    assert settings.disagreements(timed + [settings.uniform_values({})]) == [
        "MPISTRAT_COLLECTIVE_TIMEOUT differs between ranks: ranks 0, 1 have 'a timeout'; "
        "rank 2 has 'no timeout'"]
