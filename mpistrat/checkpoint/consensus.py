"""Every rank must save the same values: checked at save, at the cost of one small all-reduce.

A checkpoint holds each value once (as TensorFlow saves a mirrored variable
once), its partitions written by different ranks. A value the ranks do not
agree on (a per-rank buffer, a locally computed loss, an array holding the
rank id) would be saved as a mosaic of the ranks' copies, or as bytes that
fail their own checksum. So the save refuses it: every rank computes the
CRC-32 of every partition of every value (the CRCs the file records), folds
them with each value's path, shape, dtype and kind into one digest, and the
ranks compare digests with one all-reduce. Only when they differ are the
per-value digests gathered, to name the values and the ranks that differ; every
rank raises the same ``ValueError`` before a byte is written::

    >>> from mpistrat.checkpoint.consensus import value_digest, describe_differences
    >>> a = value_digest("float64", (3,), "array", [123])
    >>> b = value_digest("float64", (4,), "array", [456])
    >>> describe_differences([{"w": ("float64[3]", a)}, {"w": ("float64[4]", b)}])
    "'w': rank 0: float64[3]; rank 1: float64[4]"
"""

import hashlib
from typing import Dict, List, Sequence, Tuple

import numpy as np

from mpistrat.collectives.agreement import describe_views
from mpistrat.collectives.objects import allgather_object

__all__ = ["value_digest", "agree_values", "describe_differences"]

_SHOWN = 5  # values named in the error (the count of the others follows)


def value_digest(dtype: str, shape: Tuple[int, ...], kind: str, crcs: Sequence[int]) -> str:
    """A digest of one value as this rank would save it."""
    text = repr((dtype, tuple(int(d) for d in shape), kind, [int(c) for c in crcs]))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def describe_differences(tables: List[Dict[str, Tuple[str, str]]]) -> str:
    """``'path': rank 0: ...; rank 1: ...`` for each value whose digest differs between ranks."""
    paths = sorted(set().union(*tables))
    lines = []
    for path in paths:
        digests = [t.get(path, ("absent", "")) for t in tables]
        if any(d != digests[0] for d in digests[1:]):
            shapes = [d[0] for d in digests]
            same_shape = all(s == shapes[0] for s in shapes)
            views = [f"{s} #{d[1]}" if same_shape else s for s, d in zip(shapes, digests)]
            lines.append(f"{path!r}: {describe_views(views)}")
    shown = lines[:_SHOWN]
    if len(lines) > _SHOWN:
        shown.append(f"and {len(lines) - _SHOWN} more values")
    return "; ".join(shown)


def agree_values(engine, table: Dict[str, Tuple[str, str]], what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank holds the same ``table``
    (path -> (description, digest)); collective, one all-reduce when they agree."""
    whole = hashlib.blake2b(repr(sorted(table.items())).encode(), digest_size=8).digest()
    digest = int.from_bytes(whole, "little") >> 2
    low_high = engine.all_reduce(np.array([digest, -digest], dtype=np.int64), "MAX")
    if low_high[0] == -low_high[1]:
        return
    tables = allgather_object(engine, table, f"{what}: comparing values")
    raise ValueError(f"{what} failed: values differ between ranks: "
                     f"{describe_differences(tables)}. A checkpoint saves each value once, so "
                     f"every rank must hold the same value: reduce per-rank values across "
                     f"ranks before saving (strategy.reduce), or keep them out of the checkpoint")
