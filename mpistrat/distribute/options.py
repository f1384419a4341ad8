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

    Under ``TPUStrategy``, ``experimental_fetch_to_device`` (``None`` means yes)
    lays each batch out on the devices before ``run`` needs it, and
    ``experimental_per_replica_buffer_size`` batches are prepared ahead in a
    thread (0: in the consuming thread, no thread; ``None``: 1 on accelerators,
    0 on CPU devices, whose compute shares the host's cores with that thread:
    measured there, the thread cost 30 % per step). The other fields are accepted
    for compatibility.
    """

    experimental_fetch_to_device: Optional[bool] = None
    experimental_replication_mode: Any = None
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: Optional[int] = None


@dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run`` (accepted for compatibility; MPI replicas ignore them)."""

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None
