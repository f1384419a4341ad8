"""``InputOptions`` and ``RunOptions``, with TensorFlow's field names.

    >>> import mpistrat as ms
    >>> ms.InputOptions(experimental_per_replica_buffer_size=2).experimental_per_replica_buffer_size
    2
"""

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["InputOptions", "RunOptions"]


@dataclass(frozen=True)
class InputOptions:
    """Options for distributed datasets (``experimental_distribute_dataset`` and friends).

    ``experimental_per_replica_buffer_size`` is the prefetch depth per replica.
    """

    experimental_fetch_to_device: Optional[bool] = None
    experimental_replication_mode: Any = None
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1


@dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run`` (accepted for compatibility; MPI replicas ignore them)."""

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None
