"""Collective backends, kept in one ordered list; the first usable one runs.

Horovod's shape: each backend answers ``usable(kind, implementation, caps,
topology)`` with a reason; ``select_backend`` walks ``BACKENDS`` in order and
is the only place that chooses a backend (``algorithms.explain_algorithm``
is the only place that chooses an algorithm). Device arrays prefer NCCL,
then a CUDA-aware MPI, then staging through host memory; host arrays always
take host MPI::

    >>> from mpistrat.collectives.backends import select_backend
    >>> from mpistrat.collectives.options import CommunicationImplementation as Impl
    >>> from mpistrat.runtime.devices import Capabilities
    >>> select_backend("numpy", Impl.AUTO, Capabilities(False, False)).name
    'host-mpi'
    >>> select_backend("cupy", Impl.AUTO, Capabilities(False, False, True)).name
    'staged-host-mpi'
    >>> select_backend("cupy", Impl.AUTO, Capabilities(True, False, True)).name
    'cuda-aware-mpi'
"""

import functools
from typing import List, Tuple

from mpistrat.collectives.backends.base import Backend, DeviceBufferRefused
from mpistrat.collectives.backends.cuda_aware import CudaAwareMPI
from mpistrat.collectives.backends.host import HostMPI
from mpistrat.collectives.backends.nccl import NcclBackend, NcclInitError
from mpistrat.collectives.backends.staged import StagedHostMPI
from mpistrat.collectives.options import CommunicationImplementation

__all__ = ["Backend", "HostMPI", "StagedHostMPI", "CudaAwareMPI", "NcclBackend", "BACKENDS",
           "select_backend", "explain_backend", "DeviceBufferRefused", "NcclInitError"]

BACKENDS: List[Backend] = [NcclBackend(), CudaAwareMPI(), StagedHostMPI(), HostMPI()]


def explain_backend(kind: str, implementation: CommunicationImplementation, caps,
                    topology=None) -> Tuple[Backend, str]:
    """The first usable backend and why; ``ValueError`` listing every refusal if none."""
    refusals = []
    for backend in BACKENDS:
        ok, why = backend.usable(kind, implementation, caps, topology)
        if ok:
            return backend, why
        refusals.append(f"{backend.name}: {why}")
    raise ValueError(
        f"no collective backend serves {kind} arrays with implementation={implementation.name} "
        f"({'; '.join(refusals)})")


@functools.lru_cache(maxsize=64)
def select_backend(kind: str, implementation: CommunicationImplementation, caps,
                   topology=None) -> Backend:
    """The first backend in ``BACKENDS`` that can serve ``kind`` arrays (cached per inputs)."""
    return explain_backend(kind, implementation, caps, topology)[0]
