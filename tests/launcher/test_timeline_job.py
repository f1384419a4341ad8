"""MPISTRAT_TIMELINE: a job writes one merged trace at exit, without any call to flush; set on
some ranks only (a per-rank setting), each of those writes its own trace, with no collective."""

import json

import pytest

from tests.launcher.test_settings_jobs import launch_mpmd

JOB = """
import numpy as np
import mpistrat as ms
strategy = ms.MultiWorkerMirroredStrategy()
for step in range(3):
    strategy.reduce("MEAN", [np.ones(100), np.ones(7, np.float32)], axis=None)
say("done")
"""


def test_timeline_written_at_exit_opens_as_chrome_trace(launch, tmp_path):
    path = tmp_path / "out" / "trace.json"
    result = launch(2, JOB, limit=90, env={"MPISTRAT_TIMELINE": str(path)})
    assert result.returncode == 0, result
    trace = json.loads(path.read_text())
    collectives = [e for e in trace["traceEvents"] if e.get("cat") == "collective"]
    assert sorted({e["pid"] for e in collectives}) == [0, 1]
    steps = [e for e in collectives if e["name"] == "all_reduce MEAN"]
    assert len(steps) == 6  # 3 steps on 2 ranks
    assert all(e["args"]["bytes"] == 100 * 8 + 7 * 4 for e in steps)
    assert all("wait_us" in e["args"] for e in steps)


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_timeline_on_one_rank_only_writes_that_ranks_own_trace(tmp_path, nprocs, where):
    """Issue 44: ``mpirun -n 1 env MPISTRAT_TIMELINE=t.json python job.py : -n 1 python job.py``
    used to wait at exit in a merge only that rank joined, until the health check ended the
    job (exit 1, no trace). Now that rank writes ``t.json.rank<r>.json`` alone, the others
    write nothing, and the job exits 0."""
    rank = 0 if where == "first" else nprocs - 1
    path = tmp_path / "out" / "trace.json"
    parts = [{} for _ in range(nprocs)]
    parts[rank] = {"MPISTRAT_TIMELINE": str(path)}
    code, output, _ = launch_mpmd(tmp_path, parts, JOB, limit=90)
    assert code == 0, output
    assert output.splitlines().count("done") == nprocs, output
    assert "UnavailableError" not in output and "timeline: could not write" not in output, output
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                     if p.is_file() and ("trace" in p.name or p.suffix == ".json"))
    assert written == [f"out/trace.json.rank{rank}.json"], (written, output)
    trace = json.loads((tmp_path / written[0]).read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {rank}  # its own events only
    names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in names] == [f"rank {rank}"]
    steps = [e for e in trace["traceEvents"]
             if e.get("cat") == "collective" and e["name"] == "all_reduce MEAN"]
    assert len(steps) == 3  # this rank's 3 steps
    assert all(e["args"]["bytes"] == 100 * 8 + 7 * 4 and e["args"]["ranks"] == nprocs
               for e in steps)
