"""``CommunicationOptions``: how collectives run, as in ``tf.distribute.experimental``.

    >>> import mpistrat as ms
    >>> opts = ms.CommunicationOptions(bytes_per_pack=4 << 20, timeout_seconds=30.0)
    >>> opts.implementation
    CommunicationImplementation.AUTO
"""

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["CommunicationImplementation", "CommunicationOptions", "DEFAULT_BYTES_PER_PACK"]

# Small tensors are fused into buckets of at most this many bytes when
# ``bytes_per_pack`` is 0; see docs/benchmarks.md for the measurement behind it.
DEFAULT_BYTES_PER_PACK = 4 << 20
_ALGORITHMS = ("auto", "mpi", "ring", "hierarchical", "reduce_broadcast", "rabenseifner")


class CommunicationImplementation(enum.Enum):
    """Which transport collectives use: ``AUTO`` picks by capability."""

    AUTO = "AUTO"
    MPI = "MPI"
    NCCL = "NCCL"
    # TensorFlow's name for its own collective ring; accepted as MPI here.
    RING = "MPI"

    def __repr__(self) -> str:
        return f"CommunicationImplementation.{self.name}"


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-replica collectives.

    ``bytes_per_pack``: fuse small tensors into buckets of up to this many
    bytes (0 picks ``DEFAULT_BYTES_PER_PACK``). ``timeout_seconds``: a
    collective that has not completed after this long raises
    ``DeadlineExceededError`` on the ranks that waited (``None``: wait
    forever, unless ``MPISTRAT_COLLECTIVE_TIMEOUT`` sets a default).
    ``implementation``: ``AUTO``, ``MPI`` or ``NCCL``; ``NCCL`` makes device
    arrays use NCCL (host arrays still travel over MPI) and raises naming the
    reason where NCCL cannot run. ``algorithm`` (an mpistrat extension, set
    by ``cross_device_ops``): ``"auto"``, ``"mpi"``, ``"ring"``,
    ``"hierarchical"``, ``"reduce_broadcast"`` or ``"rabenseifner"``. ``deterministic``:
    SUM and MEAN give bitwise identical results whatever the rank count,
    algorithm, fusion or order (exact fixed-point sums,
    ``collectives/reproducible.py``; ``MPISTRAT_DETERMINISTIC=1`` turns it on
    for every engine). Every rank must pass the same value.
    """

    bytes_per_pack: int = 0
    timeout_seconds: Optional[float] = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    algorithm: str = "auto"
    deterministic: bool = False

    def __post_init__(self):
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int, got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive or None, got {self.timeout_seconds!r}")
        if isinstance(self.implementation, str):
            object.__setattr__(self, "implementation",
                               CommunicationImplementation[self.implementation.upper()])
        if self.algorithm not in _ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {self.algorithm!r}")

    @property
    def pack_bytes(self) -> int:
        """The bucket size in effect."""
        return self.bytes_per_pack or DEFAULT_BYTES_PER_PACK

    def merge(self, other: Optional["CommunicationOptions"]) -> "CommunicationOptions":
        """``other``'s non-default fields over these (per-call options over the strategy's)."""
        if other is None:
            return self
        return CommunicationOptions(
            bytes_per_pack=other.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=other.timeout_seconds if other.timeout_seconds is not None
            else self.timeout_seconds,
            implementation=other.implementation
            if other.implementation is not CommunicationImplementation.AUTO else self.implementation,
            algorithm=other.algorithm if other.algorithm != "auto" else self.algorithm,
            deterministic=bool(other.deterministic or self.deterministic),
        )
