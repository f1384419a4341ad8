"""``StagedHostMPI``: device arrays copied to host memory, combined over MPI, copied back.

For an MPI that is not CUDA-aware and ranks that cannot use NCCL (two ranks
on one GPU). CuPy arrays (and JAX GPU arrays, through DLPack, when CuPy is
installed) are fused on the device, then each bucket goes through a
persistent pinned host buffer in chunks: the copy of one chunk runs on a
copy stream while the host all-reduces another (``pipeline.py``). Other
device arrays (JAX on CPU, or without CuPy) are copied whole::

    >>> from mpistrat.collectives.backends.staged import StagedHostMPI
    >>> from mpistrat.collectives.options import CommunicationImplementation as Impl
    >>> from mpistrat.runtime.devices import Capabilities
    >>> StagedHostMPI().usable("jax", Impl.AUTO, Capabilities(False, False))[0]
    True
"""

import threading
from typing import List

import numpy as np

from mpistrat.collectives.backends.base import Backend, PlanCache, options_of, wire_dtype
from mpistrat.collectives.backends.host import HostMPI, host_allreduce
from mpistrat.collectives.dtypes import is_foreign
from mpistrat.collectives.backends.pipeline import (STAGE_CHUNK_BYTES, HostBufferPool,
                                                    chunk_ranges, run_pipeline)
from mpistrat.collectives.options import CommunicationImplementation
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.runtime.devices import (array_kind, as_cupy, cupy_available, from_cupy_like,
                                      from_host, jax_on_gpu, to_host)

__all__ = ["StagedHostMPI", "CupyStager", "device_wire", "device_unpack", "divide_on_device",
           "device_buckets", "on_cuda"]


class CupyStager:
    """Copies between a CuPy buffer and pinned host memory on a dedicated stream."""

    _streams: dict = {}
    _lock = threading.Lock()

    def __init__(self, itemsize: int):
        import cupy
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self.itemsize = itemsize
        device = cupy.cuda.Device().id
        with self._lock:
            self.stream = self._streams.get(device)
            if self.stream is None:
                self.stream = self._streams[device] = cupy.cuda.Stream(non_blocking=True)
        # the copies wait for the work that produced the inputs (the caller's stream)
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)

    def _event(self):
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return event

    def down(self, device, host, start, stop):
        offset, nbytes = start * self.itemsize, (stop - start) * self.itemsize
        self._runtime.memcpyAsync(host.ctypes.data + offset, device.data.ptr + offset, nbytes,
                                  self._runtime.memcpyDeviceToHost, self.stream.ptr)
        return self._event()

    def up(self, host, device, start, stop):
        offset, nbytes = start * self.itemsize, (stop - start) * self.itemsize
        self._runtime.memcpyAsync(device.data.ptr + offset, host.ctypes.data + offset, nbytes,
                                  self._runtime.memcpyHostToDevice, self.stream.ptr)

    def wait(self, event) -> None:
        event.synchronize()

    def finish(self) -> None:
        # the host buffer is reused by the next call, so its uploads must be done
        self.stream.synchronize()


def _pinned(nbytes: int) -> np.ndarray:
    import cupyx
    return cupyx.empty_pinned((nbytes,), np.uint8)


def _cupy():
    import cupy
    return cupy


# The device-side helpers take the array module ``xp`` (CuPy by default), so the same code runs
# with NumPy standing for device memory in the CPU tests.

def device_wire(array, op, widen_half: bool = True, xp=None):
    """A contiguous flat device buffer in the dtype that travels (bool as bytes, half widened
    where MPI must reduce it; NCCL reduces half precision natively)."""
    xp = xp or _cupy()
    dtype = wire_dtype(array.dtype, op)
    if not widen_half and array.dtype.char == "e":
        dtype = array.dtype
    flat = xp.ascontiguousarray(array).reshape(-1)
    if array.dtype.char == "?":
        return flat.view(xp.uint8)
    return flat if dtype == array.dtype else flat.astype(dtype)


def divide_on_device(buffer, count: int, xp=None) -> None:
    """MEAN's division on the device (integers truncate toward zero, as TensorFlow's ``Div``)."""
    xp = xp or _cupy()
    if buffer.dtype.kind in "fc":
        buffer /= count
    elif buffer.dtype.kind in "iu":
        buffer[...] = xp.sign(buffer) * (xp.abs(buffer) // count)
    else:
        raise TypeError(f"ReduceOp.MEAN cannot average {buffer.dtype} values")


def device_unpack(flat, members, originals, wires, results, xp=None) -> None:
    """Views of a reduced flat buffer, reshaped and cast back to each original dtype."""
    xp = xp or _cupy()
    for index, start, stop in members:
        original = originals[index]
        piece = flat[start:stop].reshape(original.shape)
        if wires[index].dtype != original.dtype:
            piece = piece.view(xp.bool_) if original.dtype.char == "?" \
                else piece.astype(original.dtype)
        results[index] = piece


def device_buckets(arrays, op, options, plans: PlanCache, widen_half: bool = True, xp=None):
    """Pack the fusion buckets on the device: ``(originals, wires, [(send buffer, members)])``."""
    xp = xp or _cupy()
    originals = [as_cupy(a) for a in arrays] if xp is not np else list(arrays)
    wires = [device_wire(a, op, widen_half, xp) for a in originals]
    plan = plans.get([w.shape for w in wires], [w.dtype.str for w in wires],
                     [w.nbytes for w in wires], options.pack_bytes)
    buckets = []
    for bucket, count, members in plan:
        send = xp.concatenate([wires[i] for i in bucket.indices]) if bucket.fused \
            else wires[bucket.indices[0]]
        buckets.append((send, members))
    return originals, wires, buckets


class StagedHostMPI(Backend):
    """Device arrays through pinned host memory and the host algorithms, pipelined."""

    name = "staged-host-mpi"

    def __init__(self):
        self._host = HostMPI()
        self._plans = PlanCache()
        self._pinned = HostBufferPool(_pinned)

    def usable(self, kind, implementation, caps, topology=None):
        if kind == "numpy":
            return False, "host arrays need no staging"
        if implementation is CommunicationImplementation.NCCL:
            return False, "implementation=NCCL asks for NCCL, not staging"
        if kind == "cuda" and not caps.cupy:
            return False, "foreign CUDA arrays are staged through CuPy, which is not installed"
        return True, "device memory copied through pinned host buffers (no CUDA-aware MPI needed)"

    def all_reduce(self, comm, arrays, op, options, deadline):
        opts = options_of(options)
        if not all(on_cuda(a) for a in arrays):
            return self._whole(self._host.all_reduce, arrays, comm, op, opts, deadline)
        results = self.pipelined_all_reduce(comm, arrays, op, opts, deadline, _cupy(),
                                            CupyStager, self._pinned)
        return [from_cupy_like(r, a) for r, a in zip(results, arrays)]

    def pipelined_all_reduce(self, comm, arrays, op, options, deadline, xp, make_stager,
                             pool: HostBufferPool, chunk_bytes: int = STAGE_CHUNK_BYTES) -> List:
        """Fuse on the device, then each bucket down, across and up in overlapped chunks.

        ``xp``/``make_stager``/``pool``: CuPy, ``CupyStager`` and pinned memory on GPUs;
        NumPy, ``NumpyStager`` and plain memory in the CPU tests.
        """
        preference = getattr(options, "algorithm", "auto")
        size = comm.Get_size()
        originals, wires, buckets = device_buckets(arrays, op, options, self._plans, xp=xp)
        results: List = [None] * len(arrays)
        for send, members in buckets:
            # 1. down in chunks, 2. host all-reduce each chunk, 3. up, overlapped (pipeline.py)
            out = xp.empty_like(send)
            host = pool.take(send.nbytes)
            stager = make_stager(send.itemsize)
            try:
                view = host[:send.nbytes].view(send.dtype)
                run_pipeline(stager, send, out, view,
                             chunk_ranges(send.size, send.itemsize, chunk_bytes),
                             lambda chunk: host_allreduce(comm, chunk, chunk, op, deadline,
                                                          preference))
            finally:
                pool.give(host)
                getattr(stager, "close", lambda: None)()
            if op is ReduceOp.MEAN:
                divide_on_device(out, size, xp)
            device_unpack(out, members, originals, wires, results, xp)
        return results

    def all_gather(self, comm, arrays, counts, axis, deadline):
        return self._whole(self._host.all_gather, arrays, comm, counts, axis, deadline)

    def broadcast(self, comm, arrays, root, deadline):
        return self._whole(self._host.broadcast, arrays, comm, root, deadline)

    def _whole(self, method, arrays, comm, *args):
        """Copy each array whole to host (pinned for CuPy), run the host collective, copy back."""
        hosts = [to_host(a) for a in arrays]
        results = method(comm, hosts, *args)
        return [from_host(r, like) for r, like in zip(results, arrays)]


_CUPY_CHARS = frozenset("?bBhHiIlLqQefdFD")  # dtypes CuPy holds (not bfloat16 or float8)


def on_cuda(array) -> bool:
    """Whether ``array`` is CUDA memory CuPy can take (CuPy arrays, JAX GPU arrays, others).

    A JAX GPU array of a dtype CuPy lacks (bfloat16, float8) is not: it is copied whole
    to the host, where ``dtypes.accumulator`` widens it."""
    dtype = getattr(array, "dtype", None)
    if dtype is not None and (np.dtype(dtype).char not in _CUPY_CHARS or is_foreign(dtype)
                              or not np.dtype(dtype).isnative):
        return False
    kind = array_kind(array)
    if kind in ("cupy", "cuda"):
        return True
    return kind == "jax" and jax_on_gpu(array) and cupy_available()
