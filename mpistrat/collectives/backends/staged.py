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
from mpistrat.collectives.backends.pipeline import (HostBufferPool, chunk_ranges,
                                                    run_pipeline)
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


def device_wire(array, op, widen_half: bool = True):
    """A contiguous flat CuPy buffer in the dtype that travels (bool as bytes, half widened
    where MPI must reduce it; NCCL reduces half precision natively)."""
    import cupy
    dtype = wire_dtype(array.dtype, op)
    if not widen_half and array.dtype.char == "e":
        dtype = array.dtype
    flat = cupy.ascontiguousarray(array).reshape(-1)
    if array.dtype.char == "?":
        return flat.view(cupy.uint8)
    return flat if dtype == array.dtype else flat.astype(dtype)


def divide_on_device(buffer, count: int) -> None:
    """MEAN's division on the device (integers truncate toward zero, as TensorFlow's ``Div``)."""
    import cupy
    if buffer.dtype.kind in "fc":
        buffer /= count
    elif buffer.dtype.kind in "iu":
        buffer[...] = cupy.sign(buffer) * (cupy.abs(buffer) // count)
    else:
        raise TypeError(f"ReduceOp.MEAN cannot average {buffer.dtype} values")


def device_unpack(flat, members, originals, wires, results) -> None:
    """Views of a reduced flat buffer, reshaped and cast back to each original dtype."""
    import cupy
    for index, start, stop in members:
        original = originals[index]
        piece = flat[start:stop].reshape(original.shape)
        if wires[index].dtype != original.dtype:
            piece = piece.view(cupy.bool_) if original.dtype.char == "?" \
                else piece.astype(original.dtype)
        results[index] = piece


def device_buckets(arrays, op, options, plans: PlanCache, widen_half: bool = True):
    """Pack the fusion buckets of CuPy arrays on the device: ``(bucket send buffer, members)``."""
    import cupy
    originals = [as_cupy(a) for a in arrays]
    wires = [device_wire(a, op, widen_half) for a in originals]
    plan = plans.get([w.shape for w in wires], [w.dtype.str for w in wires],
                     [w.nbytes for w in wires], options.pack_bytes)
    buckets = []
    for bucket, count, members in plan:
        send = cupy.concatenate([wires[i] for i in bucket.indices]) if bucket.fused \
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
        import cupy
        preference = getattr(opts, "algorithm", "auto")
        size = comm.Get_size()
        originals, wires, buckets = device_buckets(arrays, op, opts, self._plans)
        results: List = [None] * len(arrays)
        for send, members in buckets:
            # 1. down in chunks, 2. host all-reduce each chunk, 3. up, overlapped (pipeline.py)
            out = cupy.empty_like(send)
            host = self._pinned.take(send.nbytes)
            try:
                view = host[:send.nbytes].view(send.dtype)
                run_pipeline(CupyStager(send.itemsize), send, out, view,
                             chunk_ranges(send.size, send.itemsize),
                             lambda chunk: host_allreduce(comm, chunk, chunk, op, deadline,
                                                          preference))
            finally:
                self._pinned.give(host)
            if op is ReduceOp.MEAN:
                divide_on_device(out, size)
            device_unpack(out, members, originals, wires, results)
        return [from_cupy_like(r, a) for r, a in zip(results, arrays)]

    def all_gather(self, comm, arrays, counts, axis, deadline):
        return self._whole(self._host.all_gather, arrays, comm, counts, axis, deadline)

    def broadcast(self, comm, arrays, root, deadline):
        return self._whole(self._host.broadcast, arrays, comm, root, deadline)

    def _whole(self, method, arrays, comm, *args):
        """Copy each array whole to host (pinned for CuPy), run the host collective, copy back."""
        hosts = [to_host(a) for a in arrays]
        results = method(comm, hosts, *args)
        return [from_host(r, like) for r, like in zip(results, arrays)]


def on_cuda(array) -> bool:
    """Whether ``array`` is CUDA memory CuPy can take (CuPy arrays, JAX GPU arrays, others)."""
    kind = array_kind(array)
    if kind in ("cupy", "cuda"):
        return True
    return kind == "jax" and jax_on_gpu(array) and cupy_available()
