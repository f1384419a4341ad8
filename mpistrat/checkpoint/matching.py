"""Matching a checkpoint's values to the objects of the graph, before anything is read.

``check_compatible`` compares a value (or a catalog entry, before reading) with its slot:
the same shape and dtype for arrays and variables, a scalar of the right kind for numbers,
else ``ValueError`` naming the object path. ``agree_plan`` runs those checks on every rank
and agrees them, with the set of values to read, before a collective read: a mismatch on
one rank raises on every rank instead of leaving the others in the read. ``read_batches``
groups the paths of a restore into batches of about 64 MiB, so a restore holds little beyond
the state itself.

    >>> import numpy as np
    >>> from mpistrat.checkpoint.graph import collect_slots
    >>> from mpistrat.checkpoint.matching import check_compatible
    >>> slot = collect_slots({"w": np.zeros(3)})["w"]
    >>> check_compatible(slot, np.ones(4), "w", "f.h5")
    Traceback (most recent call last):
    ...
    ValueError: cannot restore 'w' from f.h5: the checkpoint holds float64[4], the object is float64[3]
"""

from typing import Callable, Dict, List

import numpy as np

from mpistrat.checkpoint.graph import Slot
from mpistrat.collectives.agreement import rank_list, views_differ
from mpistrat.collectives.objects import allgather_object
from mpistrat.errors import InvalidArgumentError

__all__ = ["check_compatible", "fit_to_slot", "read_batches", "agree_plan"]

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
    if getattr(value, "refused", ""):   # (a TensorFlow variant, resource...: listed only)
        raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds a "
                         f"TensorFlow {value.refused} value there, which mpistrat cannot hold; "
                         f"leave that object out of the Checkpoint to restore the rest")
    owner = slot.owner
    if slot.kind in ("variable", "array") and (owner is not None or slot.shape is not None):
        shape, dtype = (tuple(slot.shape), np.dtype(slot.dtype)) if slot.shape is not None \
            else (tuple(owner.shape), np.dtype(owner.dtype))
        if tuple(value.shape) != shape or (value.dtype != dtype and
                                           not _integers_fit(value, dtype, path, source)):
            raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds "
                             f"{value.dtype}{list(value.shape)}, the object is {dtype}{list(shape)}")
    elif slot.kind in _NUMBER_DTYPES or slot.kind == "array":  # a Python or NumPy number
        kinds = _NUMBER_DTYPES.get(slot.kind, "biufc")
        if tuple(value.shape) != () or value.dtype.kind not in kinds:
            raise ValueError(f"cannot restore {path!r} from {source}: the checkpoint holds "
                             f"{value.dtype}{list(value.shape)}, the object is a {slot.kind} "
                             f"number")


def _integers_fit(value, dtype: np.dtype, path: str, source: str) -> bool:
    """Framework counters and RNG states change integer width between frameworks (Keras 3
    on JAX keeps ``iterations`` as int32, TensorFlow writes int64; a seed state int64 here,
    uint32 there): an integer value restores into an integer object of another width or
    signedness when every value fits (a catalog entry, not read yet, is let through to be
    checked when read); one that does not fit is an ``InvalidArgumentError`` (a
    ``ValueError``) naming the path, never a wrapped value. Floats never change kind."""
    if np.dtype(value.dtype).kind not in "iu" or dtype.kind not in "iu":
        return False
    if not isinstance(value, np.ndarray) or value.size == 0:
        return True
    info = np.iinfo(dtype)
    low, high = int(value.min()), int(value.max())
    if low < info.min or high > info.max:   # (never wrapped: a step count past 2**31 - 1)
        raise InvalidArgumentError(
            f"cannot restore {path!r} from {source}: the checkpoint holds {value.dtype} values "
            f"from {low} to {high}, which do not fit the object's {dtype}"
            + (" (Keras 3 on JAX makes an optimizer's iterations int32 where TensorFlow's are "
               "int64, so such a count cannot be held here: restore the model without that "
               "optimizer)" if dtype == np.int32 else ""))
    return True


def fit_to_slot(slot: Slot, value):
    """``value`` in its slot's integer dtype when ``check_compatible`` let a width change
    through (``_integers_fit``); any other value as it is."""
    dtype = slot.dtype if slot.shape is not None else getattr(slot.owner, "dtype", None)
    if dtype is None or not isinstance(value, np.ndarray) or value.dtype == np.dtype(dtype) \
            or value.dtype.kind not in "iu" or np.dtype(dtype).kind not in "iu":
        return value
    return value.astype(np.dtype(dtype))


def agree_plan(engine, slots: Dict[str, Slot], wanted: Dict[str, object], source: str,
               check: Callable = check_compatible) -> None:
    """Check each wanted value against its slot, then agree (collective): a mismatch on any
    rank, or ranks that would read different values, raise ``ValueError`` on every rank,
    naming the rank and the object paths, before anything is read."""
    with engine.agreed(f"restoring {source}",
                       hint="build the objects as they were saved, alike on every rank"):
        for path, entry in sorted(wanted.items()):   # (the first mismatch is this rank's)
            check(slots[path], entry, path, source)
    paths = sorted(wanted)
    if not views_differ(engine, paths):
        return
    everyone = allgather_object(engine, paths, f"the values to restore from {source}")
    common = set.intersection(*map(set, everyone))
    differences = [f"{rank_list([rank])} also restores {sorted(set(mine) - common)[:5]}"
                   for rank, mine in enumerate(everyone) if set(mine) != common]
    raise ValueError(f"restoring {source} failed: the ranks' objects differ, so they would read "
                     f"different values: {'; '.join(differences)}; every rank must build the "
                     f"same objects before restoring")
