"""What every collective backend shares: the interface, wire formats and fusion plans.

A backend answers ``usable(kind, implementation, caps, topology)`` with a
reason, and implements ``all_reduce``, ``all_gather`` and ``broadcast`` on a
list of arrays of one kind. Each concrete backend module has the same
anatomy: ``usable``, then the three collectives, then private helpers::

    >>> from mpistrat.collectives.backends.base import plan_members
    >>> [(b.indices, count, members) for b, count, members in
    ...  plan_members([(4,), (2,)], ["<f4", "<f4"], [16, 8], pack_bytes=64)]
    [((0, 1), 6, [(0, 0, 4), (1, 4, 6)])]
"""

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.algorithms import explain_algorithm
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.dtypes import accumulator, raw_bits
from mpistrat.collectives.fusion import plan_buckets
from mpistrat.collectives.options import CommunicationImplementation, CommunicationOptions
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.errors import InvalidArgumentError

__all__ = ["Backend", "DeviceBufferRefused", "refuse_device_buffers", "wire_dtype", "movable", "factor",
           "plan_members", "PlanCache", "options_of"]


_NDARRAY_ONLY = {np.ndarray}


class DeviceBufferRefused(InvalidArgumentError):
    """A device buffer reached a backend that would hand it to an MPI that is not CUDA-aware."""


def refuse_device_buffers(arrays: Sequence, backend: str) -> None:
    """Raise ``DeviceBufferRefused`` if any array exposes ``__cuda_array_interface__``.

    Passing device memory to an MPI without CUDA support crashes the rank
    (a segmentation fault on our GPU machine), so this check is never skipped (a list of
    NumPy arrays only is told by the set of its types).
    """
    if set(map(type, arrays)) <= _NDARRAY_ONLY:
        return
    for index, array in enumerate(arrays):
        if type(array) is not np.ndarray and hasattr(array, "__cuda_array_interface__"):
            raise DeviceBufferRefused(
                f"{backend}: tensor {index} ({type(array).__module__}.{type(array).__name__}) is "
                f"device memory (it exposes __cuda_array_interface__) and this backend hands "
                f"buffers to an MPI that is not CUDA-aware, which would crash the rank; device "
                f"arrays go through the staged, NCCL or CUDA-aware backends (set "
                f"MPISTRAT_CUDA_AWARE_MPI=1 only if your MPI really is CUDA-aware)")


def wire_dtype(dtype: np.dtype, op: Optional[ReduceOp]) -> np.dtype:
    """The dtype a tensor travels as over MPI: for a reduction (``op``), the dtype it combines
    in (``dtypes.accumulator``: low-precision floats in float32, integer MEAN in 64 bits, bool
    as bytes); for a gather or broadcast (``op=None``), its raw bits (``dtypes.raw_bits``)."""
    dtype = np.dtype(dtype)
    return accumulator(dtype, op) if op is not None else raw_bits(dtype)


def movable(array):
    """``array`` as MPI can move it unchanged, bit for bit (for gathers and broadcasts): types
    MPI lacks (half precision, bfloat16, float8, a foreign byte order) as unsigned integers
    of their size; other fixed-size records (strings) as bytes, ``factor(array)`` per element."""
    raw = raw_bits(array.dtype)
    if raw == array.dtype:
        return array
    if raw.itemsize == array.dtype.itemsize:
        return array.view(raw)
    return np.ascontiguousarray(array).reshape(-1).view(raw)


def factor(array) -> int:
    """How many ``movable`` elements one element of ``array`` becomes (1 but for records)."""
    return array.dtype.itemsize // raw_bits(array.dtype).itemsize


def options_of(options: Any) -> CommunicationOptions:
    """The ``CommunicationOptions`` a backend was handed (the engine's, merged with the
    call's); anything else, a plain ``bytes_per_pack`` int included, is a ``TypeError``."""
    if isinstance(options, CommunicationOptions):
        return options
    raise TypeError(f"a collective backend takes CommunicationOptions, got "
                    f"{type(options).__name__} {options!r}")


def plan_members(shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[str],
                 nbytes: Sequence[int], pack_bytes: int):
    """Fusion buckets, each with its element count and members ``(index, start, stop)``."""
    plan = []
    for bucket in plan_buckets(nbytes, dtypes, pack_bytes):
        members, offset = [], 0
        for index in bucket.indices:
            count = int(np.prod(shapes[index], dtype=np.int64))
            members.append((index, offset, offset + count))
            offset += count
        plan.append((bucket, offset, members))
    return plan


class PlanCache:
    """Fusion plans cached per signature: steady loops pay one dictionary lookup."""

    def __init__(self, limit: int = 1024):
        self._plans: dict = {}
        self._limit = limit

    def get(self, shapes, dtypes, nbytes, pack_bytes):
        key = (pack_bytes,) + tuple(zip(dtypes, shapes))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > self._limit:
                self._plans.clear()
            plan = self._plans[key] = plan_members(shapes, dtypes, nbytes, pack_bytes)
        return plan


class Backend:
    """One way to run collectives; subclasses keep the same anatomy."""

    name = "abstract"

    def usable(self, kind: str, implementation: CommunicationImplementation, caps,
               topology=None) -> Tuple[bool, str]:
        """``(True, why)`` when this backend serves ``kind`` arrays, else ``(False, why not)``."""
        raise NotImplementedError

    def algorithm_for(self, nbytes: int, size: int, topology=None,
                      preference: str = "auto") -> Tuple[str, str]:
        """``(algorithm, why)`` this backend runs for one buffer of ``nbytes``."""
        return explain_algorithm(nbytes, size, topology=topology, preference=preference)

    def all_reduce(self, comm: MPI.Comm, arrays: Sequence, op: ReduceOp,
                   options: CommunicationOptions, deadline: Optional[Deadline]) -> List:
        raise NotImplementedError

    def all_gather(self, comm: MPI.Comm, arrays: Sequence, counts: Sequence[Sequence[int]],
                   axis: int, deadline: Optional[Deadline]) -> List:
        raise NotImplementedError

    def broadcast(self, comm: MPI.Comm, arrays: Sequence, root: int,
                  deadline: Optional[Deadline]) -> List:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
