"""Distributed values: ``PerReplica`` and ``Mirrored``, as in ``tf.distribute``.

A rank holds only its local components; each is labelled with its global
replica id (``rank * local_replicas + local_index``), and so is the repr::

    >>> import numpy as np
    >>> from mpistrat import PerReplica
    >>> PerReplica((np.float32(2.0),), replica_ids=(3,))
    PerReplica:{
      3: np.float32(2.0)
    }
"""

from typing import Any, Optional, Sequence, Tuple

__all__ = ["DistributedValues", "PerReplica", "Mirrored", "local_component"]


class DistributedValues:
    """Base class: one value per local replica, with global replica ids."""

    #: All replicas' values as one device array, when the input pipeline prepared it
    #: ahead of time (``TPUStrategy`` datasets); ``run`` then skips assembling it.
    _device_array: Any = None

    def __init__(self, values: Sequence[Any], replica_ids: Optional[Sequence[int]] = None):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component")
        if replica_ids is None:
            from mpistrat.distribute.context import get_strategy
            ids = get_strategy().extended.local_replica_ids
            replica_ids = ids if len(ids) == len(values) else range(len(values))
        replica_ids = tuple(int(i) for i in replica_ids)
        if len(replica_ids) != len(values):
            raise ValueError(f"{len(values)} values but {len(replica_ids)} replica ids")
        self._values: Tuple[Any, ...] = values
        self._replica_ids: Tuple[int, ...] = replica_ids

    @property
    def values(self) -> Tuple[Any, ...]:
        """The local components, in local replica order."""
        return self._values

    @property
    def replica_ids(self) -> Tuple[int, ...]:
        """The global replica id of each local component."""
        return self._replica_ids

    def __len__(self) -> int:
        return len(self._values)

    def __jax_array__(self):
        """A distributed value handed straight to JAX (a jitted step, an Equinox model)
        is refused by name: it holds one value per local replica, not one array."""
        raise TypeError(
            f"a {type(self).__name__} (one value per local replica: {len(self._values)} here) "
            f"was passed to JAX as one array; run the step on each replica with "
            f"strategy.run(step, args=(batch,)), or take this host's values with "
            f"strategy.experimental_local_results(batch)")

    def __repr__(self) -> str:
        body = ",\n".join(f"  {rid}: {value!r}" for rid, value in zip(self._replica_ids, self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """Values that differ across replicas (``strategy.run``'s inputs and outputs)."""


class Mirrored(DistributedValues):
    """Values that are equal on every replica."""


def local_component(value: Any, index: int = 0) -> Any:
    """This rank's ``index``-th component of a distributed value; other values unchanged."""
    if isinstance(value, DistributedValues):
        if not 0 <= index < len(value):
            raise ValueError(f"{type(value).__name__} has {len(value)} local components; "
                             f"asked for local replica {index}")
        return value.values[index]
    return value
