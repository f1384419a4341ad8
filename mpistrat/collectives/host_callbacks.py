"""Collectives started inside JAX host callbacks, kept in one stream with the program's own.

A jitted step that aggregates gradients (``ms.nn.aggregate_gradients``) runs its
all-reduce in an ordered ``io_callback``. JAX dispatches the step asynchronously:
when the step's arrays live on several devices (a mesh, or
``--xla_force_host_platform_device_count``), the callback runs later on one of
JAX's threads while the main thread goes on. A ``strategy.reduce`` of the loss on
the main thread would then meet, on another rank, that rank's gradient all-reduce:
same communicator, different calls, wrong sums or a hang, and no error.

The rule kept here: a collective started outside a host callback first waits for
every host callback already dispatched (``jax.effects_barrier``), so each rank
runs its collectives in program order, the callbacks' included. The wait costs
nothing until a collective has been traced into a callback (``traced()``)::

    >>> from mpistrat.collectives import host_callbacks
    >>> host_callbacks.settle()          # nothing traced: returns at once
    >>> with host_callbacks.running():   # (what the callback's body runs under)
    ...     host_callbacks.inside()
    True
"""

import contextlib
import threading

__all__ = ["TRACED", "traced", "running", "inside", "settle"]

# Whether a collective was ever traced into a callback. Hot paths test it themselves
# (`if TRACED[0]: settle()`): one load when nothing was traced, no call.
TRACED = [False]
_local = threading.local()


def traced() -> None:
    """Note that a collective was traced into a host callback: from now on ``settle`` waits."""
    TRACED[0] = True


@contextlib.contextmanager
def running():
    """The body of a host callback's collective (it must not wait for itself)."""
    outer = getattr(_local, "depth", 0)
    _local.depth = outer + 1
    try:
        yield
    finally:
        _local.depth = outer


def inside() -> bool:
    """Whether this thread is running a host callback's collective."""
    return getattr(_local, "depth", 0) > 0


def settle() -> None:
    """Wait for every host callback dispatched so far, unless none was ever traced, or this
    is not the program's main thread (a callback's own thread, a user's ``io_callback``, the
    checkpoint writer: waiting there could wait for itself). Each collective's entry calls
    this before its first MPI call."""
    if TRACED[0] and not inside() and threading.current_thread() is threading.main_thread():
        import jax
        jax.effects_barrier()
