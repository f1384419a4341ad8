"""``ReduceOp``: how values from different replicas are combined.

``SUM`` and ``MEAN`` as in ``tf.distribute.ReduceOp``; ``MIN`` and ``MAX`` are
extensions. Strings are accepted case-insensitively::

    >>> from mpistrat import ReduceOp
    >>> ReduceOp.from_any("mean") is ReduceOp.MEAN
    True
"""

import enum

import numpy as np
from mpi4py import MPI

__all__ = ["ReduceOp", "divide_for_mean"]


class ReduceOp(enum.Enum):
    """Reduction across replicas: ``SUM``, ``MEAN``, ``MIN``, ``MAX``."""

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @classmethod
    def from_any(cls, op) -> "ReduceOp":
        """Accept a ``ReduceOp`` or its name in any case; ``ValueError`` otherwise."""
        if op.__class__ is cls:
            return op
        found = _BY_NAME.get(op) if isinstance(op, str) else None
        if found is None and isinstance(op, str):
            found = _BY_NAME.get(op.upper())
        if found is not None:
            return found
        raise ValueError(f"unknown reduce op {op!r}; use one of "
                         f"{', '.join(cls.__members__)} (strings are accepted in any case)")

    @property
    def mpi_op(self) -> MPI.Op:
        """The MPI operation that combines raw values (MEAN sums, then divides)."""
        return _MPI_OPS[self.value]

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


def divide_for_mean(buffer, count: int) -> None:
    """MEAN's final step, in place: divide by ``count`` (integers truncate toward zero, as
    TensorFlow's ``Div``; ``TypeError`` for other kinds)."""
    if buffer.dtype.kind in "fc":
        buffer /= count
    elif buffer.dtype.kind in "iu":
        buffer[...] = np.sign(buffer) * (np.abs(buffer) // count)
    else:
        raise TypeError(f"ReduceOp.MEAN cannot average {buffer.dtype} values")


_MPI_OPS = {"SUM": MPI.SUM, "MEAN": MPI.SUM, "MIN": MPI.MIN, "MAX": MPI.MAX}
_BY_NAME = {name: member for name, member in ReduceOp.__members__.items()}
