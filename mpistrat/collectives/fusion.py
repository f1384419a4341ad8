"""Fusion plan: which tensors travel together in one collective.

A pure function of sizes and dtypes, testable without MPI. Small tensors of
one dtype are packed, in order, into buckets of at most ``bytes_per_pack``
bytes; a large tensor (``ALONE_BYTES``, 1 MiB, or ``bytes_per_pack`` if
smaller) travels alone and is reduced without a packing copy::

    >>> from mpistrat.collectives.fusion import plan_buckets
    >>> [(b.dtype, b.indices) for b in plan_buckets([8, 8, 64, 8], ["f4", "i4", "f4", "f4"], 32)]
    [('f4', (0, 3)), ('i4', (1,)), ('f4', (2,))]
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

__all__ = ["Bucket", "plan_buckets", "ALONE_BYTES"]

# Tensors of this size or more are reduced without packing (see plan_buckets).
ALONE_BYTES = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """Tensors (by index into the flat list) reduced in one collective call."""

    dtype: str
    indices: Tuple[int, ...]

    @property
    def fused(self) -> bool:
        """True when the bucket packs several tensors into one buffer."""
        return len(self.indices) > 1


def plan_buckets(nbytes: Sequence[int], dtypes: Sequence, bytes_per_pack: int,
                 alone_bytes: int = ALONE_BYTES) -> List[Bucket]:
    """Group tensor indices into buckets (see the module docstring).

    A tensor of ``min(bytes_per_pack, alone_bytes)`` bytes or more travels
    alone: packing it would cost a copy as long as its reduction.

    Buckets are ordered by the position of their first tensor, so every rank
    derives the same plan from the same signature.
    """
    if len(nbytes) != len(dtypes):
        raise ValueError("plan_buckets: nbytes and dtypes differ in length")
    if bytes_per_pack <= 0:
        raise ValueError(f"bytes_per_pack must be positive, got {bytes_per_pack}")
    alone = min(bytes_per_pack, alone_bytes)
    done: List[Tuple[int, ...]] = []
    open_buckets: Dict[str, Tuple[List[int], int]] = {}
    for index, (size, dtype) in enumerate(zip(nbytes, dtypes)):
        dtype = str(dtype)
        if size >= alone:
            done.append((index,))
            continue
        members, total = open_buckets.get(dtype, ([], 0))
        if members and total + size > bytes_per_pack:
            done.append(tuple(members))
            members, total = [], 0
        members.append(index)
        open_buckets[dtype] = (members, total + size)
    done.extend(tuple(members) for members, _ in open_buckets.values() if members)
    done.sort(key=lambda indices: indices[0])
    return [Bucket(str(dtypes[indices[0]]), indices) for indices in done]
