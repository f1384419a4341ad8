"""Which strategy is current, and whether we are in replica or cross-replica context.

A thread-local stack of (strategy, replica context) entries. Outside any
scope the default single-replica strategy is current; ``scope()`` pushes a
cross-replica entry; ``run`` pushes a replica entry::

    >>> import mpistrat as ms
    >>> ms.has_strategy(), ms.get_replica_context() is not None
    (False, True)
"""

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

__all__ = ["get_strategy", "has_strategy", "get_replica_context", "in_cross_replica_context",
           "InputContext", "ValueContext", "entered", "outside_strategies"]


@dataclass
class _Entry:
    strategy: Any
    replica_context: Any  # None: cross-replica context


_local = threading.local()


def _stack() -> List[_Entry]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


_default_factory = []  # set by mpistrat.distribute.default (kept there to avoid an import loop)


def set_default_strategy_factory(factory) -> None:
    """Register the function that returns the default strategy."""
    _default_factory[:] = [factory]


def _default_strategy():
    return _default_factory[0]()


@contextlib.contextmanager
def entered(strategy: Any, replica_context: Any = None) -> Iterator[None]:
    """Push an entry for the duration of a ``with`` block (used by scope, run, merge_call)."""
    stack = _stack()
    stack.append(_Entry(strategy, replica_context))
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def outside_strategies() -> Iterator[None]:
    """Hide every entered scope for a ``with`` block: state made inside is local.

    For the library's own bookkeeping (a checkpoint's ``save_counter``), which
    must be an ordinary variable even when made inside a strategy's scope::

        >>> import mpistrat as ms
        >>> with ms.MultiWorkerMirroredStrategy().scope(), outside_strategies():
        ...     ms.Variable(0).distributed                      # doctest: +SKIP
        False
    """
    stack = _stack()
    saved = stack[:]
    del stack[:]
    try:
        yield
    finally:
        stack[:] = saved


def current_strategy_entry() -> Optional[_Entry]:
    """The innermost entry, or ``None`` outside every scope."""
    stack = _stack()
    return stack[-1] if stack else None


def get_strategy():
    """The current strategy: the innermost scope's, else the default strategy.

    >>> import mpistrat as ms
    >>> ms.get_strategy().num_replicas_in_sync
    1
    """
    entry = current_strategy_entry()
    return entry.strategy if entry else _default_strategy()


def has_strategy() -> bool:
    """True inside some strategy's ``scope()`` (or ``run``)."""
    return current_strategy_entry() is not None


def get_replica_context():
    """The current ``ReplicaContext``; ``None`` in cross-replica context.

    Outside any scope this is the default strategy's replica context.
    """
    entry = current_strategy_entry()
    if entry is None:
        return _default_strategy().extended.default_replica_context
    return entry.replica_context


def in_cross_replica_context() -> bool:
    """True inside a ``scope()`` but not inside ``run`` (or inside ``merge_call``)."""
    entry = current_strategy_entry()
    return entry is not None and entry.replica_context is None


class InputContext:
    """What an input function needs to know to read its share of the data.

    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    >>> ctx.get_per_replica_batch_size(64)
    32
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; ``ValueError`` if it does not divide."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"the global batch size ({global_batch_size}) is not divisible by "
                             f"num_replicas_in_sync ({self.num_replicas_in_sync})")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
                f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})")


class ValueContext:
    """Passed to ``experimental_distribute_values_from_function``'s function.

    >>> ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4).replica_id_in_sync_group
    1
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
