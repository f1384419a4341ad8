"""MPISTRAT_TIMELINE: a job writes one merged trace at exit, without any call to flush."""

import json

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
