"""``engine.agreed``: a block whose failure on any rank raises the same error on every rank
(the class kept as ``agree_errors`` keeps it), each failing rank named, nothing raised when
every rank's block ran; the engine stays usable afterwards."""

import errno

import numpy as np
import pytest

from mpistrat.collectives import CollectiveEngine
from mpistrat.runtime import get_world


@pytest.fixture(scope="module")
def engine():
    return CollectiveEngine(get_world().new_comm("test-agreement"))


def test_a_block_that_ran_everywhere_raises_nothing(engine):
    seen = []
    with engine.agreed("nothing fails"):
        seen.append(engine.rank)
    assert seen == [engine.rank]


def test_one_ranks_full_disk_is_every_ranks_oserror_with_its_errno(engine):
    last = engine.size - 1
    with pytest.raises(OSError) as caught:
        with engine.agreed("saving the test file", doing="writing part 3"):
            if engine.rank == last:
                raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.errno == errno.ENOSPC
    assert f"saving the test file failed: rank {last}: writing part 3: OSError" in str(caught.value)
    # the failing rank keeps its own error as the cause; the others have none
    assert (caught.value.__cause__ is not None) == (engine.rank == last)


def test_failures_on_several_ranks_are_all_named_and_the_first_gives_the_class(engine):
    with pytest.raises(ValueError) as caught:
        with engine.agreed("checking shapes"):
            if engine.rank % 2 == 0:
                raise ValueError(f"bad shape on {engine.rank}")
            raise KeyError("missing")
    text = str(caught.value)
    for rank in range(engine.size):
        assert f"rank {rank}: " in text
    assert (engine.all_reduce(np.ones(1), "SUM") == engine.size).all()   # still in step


def test_an_ms_error_keeps_its_class_on_every_rank(engine):
    from mpistrat.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="rank 0: restoring the step: Invalid"):
        with engine.agreed("restoring", doing="restoring the step"):
            if engine.rank == 0:
                raise InvalidArgumentError("the step 2**40 does not fit int32")


def test_the_checkpoint_engine_takes_the_newest_strategys_timeout_on_every_rank_alike():
    """Outside every scope a checkpoint works under the newest strategy's timeout; the
    default strategy, which a rank makes alone when it first asks for it (here rank 0 only),
    changes nothing, so every rank picks the same engine."""
    import mpistrat as ms
    from mpistrat.checkpoint.directory import io_engine
    strategy = ms.MultiWorkerMirroredStrategy(
        communication_options=ms.CommunicationOptions(timeout_seconds=600.0))
    if strategy.cluster_resolver.task_id == 0:
        ms.get_strategy()
    engine = io_engine()
    assert engine.options.timeout_seconds == 600.0
    assert engine.allgather_object(engine.options.timeout_seconds, "timeouts") == \
        [600.0] * engine.size
    with strategy.scope():
        assert io_engine() is engine
