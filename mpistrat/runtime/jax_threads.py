"""JAX's CPU thread pool on a rank bound to one core.

XLA's CPU client sizes its thread pool by the cores this process may run on (its
affinity mask) unless the ``NPROC`` environment variable names a count. A rank bound
to one core (``mpirun``'s default binding, ``srun --cpu-bind=cores`` with one CPU per
task) gets one thread. A jitted step whose host callback reads its arguments (the
``io_callback`` that ``ms.nn`` and ``hvd.DistributedOptimizer`` all-reduce in) then
waits for a copy that JAX queues on that one thread, behind the step that waits for
the callback: the step never ends (2 of 10 runs of Horovod's Keras MNIST example at
one rank bound to a core hung, 0 of 10 with two threads).

``widen_cpu_pool`` (run by ``import mpistrat``) gives JAX two threads there, before its
CPU backend starts, by setting ``NPROC=2`` when it is unset. If JAX's backends had
already started, it is too late: ``check_pool`` (run when a collective is traced into
a host callback) then raises ``FailedPreconditionError`` naming the cause, where the
step could hang::

    >>> from mpistrat.runtime import jax_threads
    >>> jax_threads.pool_needs_widening(cores=1, nproc=None)
    True
    >>> jax_threads.pool_needs_widening(cores=1, nproc="4"), jax_threads.pool_needs_widening(2, None)
    (False, False)
"""

import os
import sys
from typing import Optional

from mpistrat.errors import FailedPreconditionError

__all__ = ["MIN_THREADS", "pool_needs_widening", "widen_cpu_pool", "check_pool"]

MIN_THREADS = 2
_state = {"late": False}


def pool_needs_widening(cores: int, nproc: Optional[str]) -> bool:
    """Whether JAX's CPU pool would get fewer than ``MIN_THREADS`` threads: one core and no
    ``NPROC`` of the user's."""
    return nproc is None and cores < MIN_THREADS


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # (no affinity masks on this platform)
        return os.cpu_count() or 1


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):   # (another JAX: assume the worst)
        return True


def widen_cpu_pool() -> bool:
    """Set ``NPROC=2`` for JAX's CPU pool on a one-core rank, if JAX has not started; return
    whether it was set."""
    if not pool_needs_widening(_cores(), os.environ.get("NPROC")):
        return False
    if _backends_started():
        _state["late"] = True
        return False
    os.environ["NPROC"] = str(MIN_THREADS)
    return True


def _steps_on_cpu() -> bool:
    """Whether JAX's steps run on its CPU backend (on a GPU or TPU the CPU pool only copies
    the callback's arguments, and is free to)."""
    try:
        import jax
        return jax.default_backend() == "cpu"
    except Exception:  # noqa: BLE001  (no JAX backend at all: nothing can hang)
        return False


def check_pool(what: str = "a collective traced into a JAX host callback") -> None:
    """Raise ``FailedPreconditionError`` where JAX started with one CPU thread before
    ``import mpistrat`` could widen its pool and runs its steps on the CPU (a step with
    ``what`` could hang). NPROC set after JAX started changes nothing: it is not read again."""
    if _state["late"] and _steps_on_cpu():
        from mpistrat.runtime.world import get_world
        world = get_world()
        raise FailedPreconditionError(
            f"rank {world.rank} (host {world.hostname}): {what} (ms.nn, "
            f"hvd.DistributedOptimizer): JAX's CPU backend started with one thread (this "
            f"rank may use {_cores()} core) before mpistrat was imported: the "
            f"step can hang waiting for a copy queued behind itself. Import mpistrat before "
            f"using JAX, set NPROC={MIN_THREADS} in the job's environment, or bind each rank "
            f"to two cores or none (mpirun --bind-to none); see docs/troubleshooting.md")
