"""Partition math shared by collectives and checkpoints: pure functions of sizes.

    >>> from mpistrat.partition import even_ranges
    >>> even_ranges(10, 3)
    [(0, 4), (4, 7), (7, 10)]
"""

from typing import List, Tuple

__all__ = ["even_ranges"]


def even_ranges(count: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``count`` items into ``parts`` contiguous ``(start, stop)`` ranges.

    The first ``count % parts`` ranges hold one item more; ranges may be
    empty when ``count < parts``.
    """
    if parts < 1 or count < 0:
        raise ValueError(f"even_ranges needs count >= 0 and parts >= 1, got {count}, {parts}")
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
