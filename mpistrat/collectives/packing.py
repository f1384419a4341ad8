"""Pack many host tensors into fused buffers, reduce, and unpack: vectorised and cached.

The plan of a list of tensors (``FusedPlan``) is computed once per signature
(the ``(dtype, shape)`` of each tensor, built in C) and reused by every later
call with the same structure, as in a training loop. Each fused bucket is
packed by one ``np.concatenate`` into a new buffer and unpacked by *runs*:
consecutive tensors of one dtype and shape come back as the rows of one
reshaped view (NumPy makes the views in C), not one Python slice each::

    >>> from mpistrat.collectives.packing import runs_of
    >>> runs_of([0, 1, 2, 5], [(4,), (4,), (2, 2), (4,)], [4, 4, 4, 4])
    [(0, 2, (4,), 0, 8), (2, 1, (2, 2), 8, 12), (5, 1, (4,), 12, 16)]
"""

import operator
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.algorithms import allreduce, choose_algorithm
from mpistrat.collectives.deadline import Deadline
from mpistrat.collectives.dtypes import accumulator, from_wire, to_wire
from mpistrat.collectives.fusion import ALONE_BYTES, plan_buckets
from mpistrat.collectives.out_buffers import OUT_ALONE_BYTES, same_buffer
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean

__all__ = ["FusedPlan", "runs_of", "wire_dtype", "fused_all_reduce"]

_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
Run = Tuple[int, int, tuple, int, int]  # (first index, count, shape, start, stop) in elements


def wire_dtype(dtype: np.dtype, op: ReduceOp = ReduceOp.MAX) -> np.dtype:
    """The dtype a tensor travels and combines as (``dtypes.accumulator``): bool as bytes,
    half precision, bfloat16 and float8 as float32, integers of a MEAN in 64 bits."""
    return accumulator(np.dtype(dtype), op)


def runs_of(indices: Sequence[int], shapes: Sequence[tuple], sizes: Sequence[int]) -> List[Run]:
    """Group a bucket's members into runs of consecutive indices with one shape (pure).

    ``shapes``/``sizes`` are per member (a "shape" may be any comparable key, such
    as ``(dtype, shape)``); offsets count elements from the bucket start.
    """
    runs: List[Run] = []
    offset = 0
    for index, shape, size in zip(indices, shapes, sizes):
        if runs:
            first, count, run_shape, start, stop = runs[-1]
            if index == first + count and shape == run_shape:
                runs[-1] = (first, count + 1, run_shape, start, stop + size)
                offset += size
                continue
        runs.append((index, 1, shape, offset, offset + size))
        offset += size
    return runs


class _BucketPlan:
    __slots__ = ("indices", "fused", "wire", "count", "runs", "converts", "span")

    def __init__(self, indices, wire, count, runs, converts, span):
        self.indices, self.wire, self.count = indices, wire, count
        self.fused = len(indices) > 1
        self.runs, self.converts, self.span = runs, converts, span


class FusedPlan:
    """How one signature's tensors travel: buckets (``fusion.plan_buckets``) with runs."""

    def __init__(self, signature: Sequence[Tuple[np.dtype, tuple]], pack_bytes: int,
                 op: ReduceOp = ReduceOp.SUM, alone_bytes: int = ALONE_BYTES):
        wires = [wire_dtype(d, op) for d, _ in signature]
        sizes = [int(np.prod(s, dtype=np.int64)) for _, s in signature]
        nbytes = [n * w.itemsize for n, w in zip(sizes, wires)]
        self.buckets: List[_BucketPlan] = []
        for bucket in plan_buckets(nbytes, [w.str for w in wires], pack_bytes, alone_bytes):
            idx = bucket.indices
            runs = [(first, count, key[1], start, stop) for first, count, key, start, stop
                    in runs_of(idx, [signature[i] for i in idx], [sizes[i] for i in idx])]
            converts = any(signature[i][0] != wires[i] for i in idx)
            contiguous = idx == tuple(range(idx[0], idx[-1] + 1))
            span = (idx[0], idx[-1] + 1) if contiguous else None
            self.buckets.append(_BucketPlan(idx, wires[idx[0]], sum(sizes[i] for i in idx),
                                            runs, converts, span))


def fused_all_reduce(comm: MPI.Comm, arrays: Sequence[np.ndarray], op: ReduceOp, pack_bytes: int,
                     deadline: Optional[Deadline], plans: Dict[tuple, FusedPlan],
                     combine: Optional[Callable[[np.ndarray, np.ndarray], object]] = None,
                     signature: Optional[tuple] = None,
                     out: Optional[Sequence[np.ndarray]] = None) -> List:
    """All-reduce a list of host arrays: fused buckets and lone large tensors.

    ``plans`` caches one ``FusedPlan`` per signature; results are new arrays
    (views of the new buffers, which are the caller's), the inputs are left untouched. With ``out``
    (``collectives/out_buffers.py``, checked by the caller) the results are written there and
    tensors from ``OUT_ALONE_BYTES`` are reduced alone, each straight into its own ``out``.
    ``combine(send, recv)`` runs one buffer's all-reduce (the host backend passes its
    topology-aware choice); by default the algorithm that suits the size. ``signature``:
    the arrays' ``(dtype, shape)`` pairs where the caller has built them already.
    """
    if signature is None:
        signature = tuple(map(_DTYPE_SHAPE, arrays))
    key = (pack_bytes, op, signature, out is not None)
    plan = plans.get(key)
    if plan is None:  # (wire_dtype raises TypeError for what the op cannot combine)
        if len(plans) > 1024:
            plans.clear()
        plan = plans[key] = FusedPlan(signature, pack_bytes, op,
                                      ALONE_BYTES if out is None else OUT_ALONE_BYTES)
    size = comm.Get_size()
    results: List = [None] * len(arrays)
    for bucket in plan.buckets:
        if out is not None and not bucket.fused and \
                arrays[bucket.indices[0]].dtype == bucket.wire:   # straight into out
            index = bucket.indices[0]
            target = out[index]
            _into(comm, arrays[index], target, op, deadline, combine, size)
            results[index] = target
            continue
        buffer = np.empty((bucket.count,), bucket.wire)  # (the caller's: results view it)
        if bucket.fused:  # 1. pack: one concatenate (casting half/bool on the way)
            members = arrays[bucket.span[0]:bucket.span[1]] if bucket.span else \
                [arrays[i] for i in bucket.indices]
            np.concatenate(members, axis=None, out=buffer, casting="unsafe")
            send = buffer
        else:             # or a lone large tensor, reduced without a packing copy
            send = np.asarray(arrays[bucket.indices[0]])
            if send.dtype != bucket.wire or not send.flags.c_contiguous:
                send = to_wire(send, bucket.wire)
            send = send.reshape(-1)
        # 2. combine across ranks with the algorithm that suits the size (and topology)
        _combine(comm, send, buffer, op, deadline, combine, size)
        # 3. unpack by runs: views of the buffer, converted back where the dtype travelled wide
        for first, count, shape, start, stop in bucket.runs:
            piece = buffer[start:stop]
            if bucket.converts:
                original = arrays[first].dtype
                piece = from_wire(piece, original)
            if out is not None:   # (a fused bucket, or a tensor that travels wide)
                rows = piece.reshape((count,) + shape)
                for k in range(count):
                    target = results[first + k] = out[first + k]
                    target[...] = rows[k]   # (same shape and dtype: out_problem saw to it)
            elif count == 1:
                results[first] = piece.reshape(shape)
            else:
                results[first:first + count] = piece.reshape((count,) + shape)
    return results


def _combine(comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp, deadline, combine,
             size: int) -> None:
    """``recv`` = ``send`` combined across ranks (in place where ``send is recv``): by
    ``combine``, or the algorithm that suits the size; a MEAN divided."""
    if combine is None:
        allreduce(comm, send, recv, op, deadline,
                  choose_algorithm(recv.nbytes, size, in_place=send is recv))
    else:
        combine(send, recv)
    if op is ReduceOp.MEAN:
        divide_for_mean(recv, size)


def _into(comm, array: np.ndarray, target: np.ndarray, op: ReduceOp, deadline, combine,
          size: int) -> None:
    """One tensor reduced into ``target`` (in place where ``target`` is ``array``'s memory)."""
    recv = target.reshape(-1)
    send = recv if same_buffer(array, target) else np.ascontiguousarray(array).reshape(-1)
    _combine(comm, send, recv, op, deadline, combine, size)
