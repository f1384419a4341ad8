"""``ReplicaContext``: what code inside ``strategy.run`` sees.

    >>> import mpistrat as ms
    >>> ctx = ms.get_replica_context()          # the default strategy's
    >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
    (0, 1)
    >>> float(ctx.all_reduce("SUM", 3.0))
    3.0
"""

from typing import Any, Callable, Optional

from mpistrat.collectives import CommunicationOptions, ReduceOp
from mpistrat.distribute.context import entered
from mpistrat.distribute.scalar_results import scalars_to_numpy

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """The context of one replica: its id, the replica count, and collectives."""

    def __init__(self, strategy: Any, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)

    @property
    def strategy(self):
        """The strategy that runs this replica."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """The global id of this replica, in ``[0, num_replicas_in_sync)``."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in collectives."""
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self):
        """The devices of this replica (a 1-tuple of device names)."""
        return (self._strategy.extended.worker_devices[0],)

    def all_reduce(self, reduce_op, value: Any, options: Optional[CommunicationOptions] = None):
        """Combine a nest of arrays over all replicas; every replica gets the result.

        ``MEAN`` divides by ``num_replicas_in_sync``.
        """
        op = ReduceOp.from_any(reduce_op)
        return scalars_to_numpy(self._strategy.extended.engine.all_reduce(value, op, options))

    def all_gather(self, value: Any, axis: int, options: Optional[CommunicationOptions] = None):
        """Concatenate a nest of arrays from all replicas along ``axis``, in replica order."""
        return self._strategy.extended.engine.all_gather(value, axis, options)

    def merge_call(self, merge_fn: Callable, args=(), kwargs=None):
        """Call ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context.

        Every replica calls ``merge_call``; ``merge_fn`` may use
        ``strategy.reduce`` and the other cross-replica methods.
        """
        with entered(self._strategy, None):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
