"""Launcher tests: behaviour that ends or kills a whole MPI job."""

JOB_RANK1_RAISES = """
import time
import numpy as np
import mpistrat as ms
strategy = ms.MultiWorkerMirroredStrategy()
rank = strategy.extended.local_replica_ids[0]
if rank == 1:
    raise RuntimeError("boom on purpose")
strategy.reduce("SUM", np.ones(3), axis=None)   # rank 0 waits here for rank 1
time.sleep(60)
print("unreachable")
"""


def test_uncaught_exception_on_one_rank_ends_the_job_promptly(launch):
    result = launch(2, JOB_RANK1_RAISES, limit=60)
    assert result.returncode != 0, result
    assert result.returncode != 124, f"the job hung until the time limit: {result}"
    assert result.seconds < 30, result
    assert "[mpistrat rank 1/2]" in result.output, result
    assert "RuntimeError: boom on purpose" in result.output, result
    assert "unreachable" not in result.output


def test_single_rank_exception_prints_a_plain_traceback(launch):
    result = launch(1, "import mpistrat\nraise ValueError('plain traceback')\n", limit=60)
    assert result.returncode != 0
    assert "ValueError: plain traceback" in result.output, result


JOB_RANK1_NEVER_JOINS = """
import sys, time
import numpy as np
import mpistrat as ms
strategy = ms.MultiWorkerMirroredStrategy(
    communication_options=ms.CommunicationOptions(timeout_seconds=1.0))
rank = strategy.extended.local_replica_ids[0]
if rank == 0:
    try:
        strategy.reduce("SUM", np.ones(3), axis=None)
    except ms.errors.DeadlineExceededError as err:
        say("rank 0 caught:", err)
        raise
time.sleep(60)
"""


def test_collective_timeout_raises_deadline_exceeded(launch):
    result = launch(2, JOB_RANK1_NEVER_JOINS, limit=60)
    assert result.returncode not in (0, 124), result
    assert result.seconds < 30, result
    assert "rank 0 caught:" in result.output, result
    assert "timeout_seconds=1" in result.output, result
    assert "DeadlineExceededError" in result.output, result


JOB_MIRRORED = """
import sys
import mpistrat as ms
try:
    ms.MirroredStrategy()
except ValueError as err:
    say("refused:", err)
s = ms.MultiWorkerMirroredStrategy()
say("mwms replicas", s.num_replicas_in_sync)
"""


def test_mirrored_strategy_refuses_several_nodes(launch):
    result = launch(2, JOB_MIRRORED, env={"MPISTRAT_RANKS_PER_NODE": "1"}, limit=60)
    assert result.returncode == 0, result
    assert result.output.count("refused:") == 2, result
    assert "MultiWorkerMirroredStrategy" in result.output
    assert "2 nodes" in result.output
    assert result.output.count("mwms replicas 2") == 2, result


def test_mirrored_strategy_on_one_node_spans_its_ranks(launch):
    result = launch(3, "import sys, mpistrat as ms\nsys.stdout.write('replicas %d\\n' % "
                       "ms.MirroredStrategy().num_replicas_in_sync)\n", limit=60)
    assert result.returncode == 0, result
    assert result.output.count("replicas 3") == 3, result


def test_trace_names_each_collective_and_rank(launch):
    job = ("import numpy as np, mpistrat as ms\n"
           "s = ms.MultiWorkerMirroredStrategy()\n"
           "s.reduce('SUM', np.ones(3), axis=None)\n")
    result = launch(2, job, env={"MPISTRAT_TRACE": "1"}, limit=60)
    assert result.returncode == 0, result
    for rank in (0, 1):
        assert f"[mpistrat rank {rank}] #1 all_reduce SUM: 1 tensors, 3 elements" in result.output
        assert f"[mpistrat rank {rank}] #1 all_reduce SUM: 1 numpy tensors via validation-probe" \
            in result.output, result
