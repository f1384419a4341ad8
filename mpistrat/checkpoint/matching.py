"""Matching a checkpoint's values to the objects of the graph, before anything is read.

``check_compatible`` compares a value (or a catalog entry, before reading) with its slot:
the same shape and dtype for arrays and variables, a scalar of the right kind for numbers,
else ``ValueError`` naming the object path. ``read_batches`` groups the paths of a restore
into batches of about 64 MiB, so a restore holds little beyond the state itself.

    >>> import numpy as np
    >>> from mpistrat.checkpoint.graph import collect_slots
    >>> from mpistrat.checkpoint.matching import check_compatible
    >>> slot = collect_slots({"w": np.zeros(3)})["w"]
    >>> check_compatible(slot, np.ones(4), "w", "f.h5")
    Traceback (most recent call last):
    ...
    ValueError: cannot restore 'w' from f.h5: the checkpoint holds float64[4], the object is float64[3]
"""

from typing import List

import numpy as np

from mpistrat.checkpoint.graph import Slot

__all__ = ["check_compatible", "read_batches"]

_BATCH_BYTES = 64 << 20


def read_batches(catalog) -> List[List[str]]:
    """Paths in batches of about 64 MiB (a large value alone), all ``state`` values last and
    together (their owner restores them at once), so a restore holds at most the state plus
    one batch in memory."""
    batches: List[List[str]] = [[]]
    size = 0
    for path in sorted(p for p, e in catalog.items() if e.kind != "state"):
        if batches[-1] and size + catalog[path].nbytes > _BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(path)
        size += catalog[path].nbytes
    batches.append(sorted(p for p, e in catalog.items() if e.kind == "state"))
    return [b for b in batches if b]


_NUMBER_DTYPES = {"int": "iu", "float": "fiu", "bool": "b"}


def check_compatible(slot: Slot, value, path: str, source: str) -> None:
    """``value`` (an array, or a catalog entry before reading) fits the object at ``path``."""
    owner = slot.owner
    if slot.kind in ("variable", "array") and (owner is not None or slot.shape is not None):
        shape, dtype = (tuple(slot.shape), np.dtype(slot.dtype)) if slot.shape is not None \
            else (tuple(owner.shape), np.dtype(owner.dtype))
        if tuple(value.shape) != shape or value.dtype != dtype:
            raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds "
                             f"{value.dtype}{list(value.shape)}, the object is {dtype}{list(shape)}")
    elif slot.kind in _NUMBER_DTYPES or slot.kind == "array":  # a Python or NumPy number
        kinds = _NUMBER_DTYPES.get(slot.kind, "biufc")
        if tuple(value.shape) != () or value.dtype.kind not in kinds:
            raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds "
                             f"{value.dtype}{list(value.shape)}, the object is a {slot.kind} "
                             f"number")
