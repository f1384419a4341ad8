"""TensorFlow's rebatch split of one global batch over the replicas. Pure functions.

A batch of ``B`` rows is cut in replica order into slices of ``ceil(B / N)``
rows; the last non-empty slice takes what remains and later replicas get
0-row slices (measured with TensorFlow 2.21, DESIGN.md section 2)::

    >>> from mpistrat.data.rebatch import rebatch_slices
    >>> rebatch_slices(5, 4)
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    >>> rebatch_slices(4, 4)
    [(0, 1), (1, 2), (2, 3), (3, 4)]
"""

from typing import List, Tuple

__all__ = ["rebatch_slices"]


def rebatch_slices(batch_rows: int, replicas: int) -> List[Tuple[int, int]]:
    """The ``(start, stop)`` rows of each replica's slice of a batch of ``batch_rows``."""
    if replicas < 1 or batch_rows < 0:
        raise ValueError(f"rebatch_slices needs batch_rows >= 0 and replicas >= 1, "
                         f"got {batch_rows}, {replicas}")
    per_replica = -(-batch_rows // replicas)
    slices = []
    for replica in range(replicas):
        start = min(replica * per_replica, batch_rows)
        slices.append((start, min(start + per_replica, batch_rows)))
    return slices
