"""The default strategy: one replica, no communication, current outside every scope.

    >>> import mpistrat as ms
    >>> s = ms.get_strategy()
    >>> s.num_replicas_in_sync, float(s.reduce("SUM", 2.0, axis=None))
    (1, 2.0)
"""

import contextlib
import functools

from mpi4py import MPI

from mpistrat.collectives import CollectiveEngine
from mpistrat.distribute.context import set_default_strategy_factory
from mpistrat.distribute.strategy import Strategy

__all__ = ["DefaultStrategy", "default_strategy"]


class DefaultStrategy(Strategy):
    """A single replica on this process; collectives are identities."""

    _made_by_every_rank = False   # made by each process when it first asks for it

    def __init__(self):
        super().__init__(CollectiveEngine(MPI.COMM_SELF), ("/job:localhost/replica:0/task:0/device:CPU:0",))

    @contextlib.contextmanager
    def scope(self):
        """Entering the default strategy's scope changes nothing (as in TensorFlow)."""
        yield self


@functools.lru_cache(maxsize=None)
def default_strategy() -> DefaultStrategy:
    """The process-wide default strategy."""
    return DefaultStrategy()


set_default_strategy_factory(default_strategy)
