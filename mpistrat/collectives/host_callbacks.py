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
nothing until a collective has been traced into a callback (``traced()``).

Inside ``shard_map`` or ``pmap`` (a program with per-device semantics) JAX runs the
callback once per device, each on its own thread and at the same time. Those calls
must not each start a collective: the ranks' calls would meet in whatever order the
threads reach MPI (other sums, or a mismatch). ``gathered`` joins them instead: the
devices of one call wait for each other, the last to come runs one collective for all
of them (device ``i``'s values meet device ``i``'s of every other rank), and each takes
its own part of the result::

    >>> from mpistrat.collectives import host_callbacks
    >>> host_callbacks.settle()          # nothing traced: returns at once
    >>> with host_callbacks.running():   # (what the callback's body runs under)
    ...     host_callbacks.inside()
    True
"""

import contextlib
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from mpistrat.errors import DeadlineExceededError

__all__ = ["TRACED", "traced", "running", "inside", "settle", "gathered"]

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


class _Call:
    """One call of a per-device callback: each device's values, then the shared result."""

    def __init__(self, count: int):
        self.parts: Dict[int, list] = {}
        self.result: Optional[list] = None
        self.error: Optional[BaseException] = None
        self.done = False
        self.left = count   # devices yet to take their part


_calls = threading.Condition()
_seen: Dict[tuple, int] = {}     # (devices, position) -> calls made so far
_open: Dict[tuple, _Call] = {}   # (devices, call number) -> its gathering


def gathered(count: int, position: int, values: list,
             reduce: Callable[[List[list]], Sequence[list]], timeout: Optional[float]) -> list:
    """Device ``position`` of ``count`` gives ``values`` to this call of a per-device callback
    and gets back its part of ``reduce(parts)`` (``parts``: every device's values in position
    order). The last device to come runs ``reduce`` on its thread, once; every device waits
    for it, at most ``timeout`` seconds for the others to come (``None``: no limit), then
    as long as ``reduce`` takes (its own deadline). An error of ``reduce`` is raised on every
    device's thread. Calls are counted per device: JAX runs one device's callbacks in
    program order, so the n-th call of every device is one call.

        >>> gathered(1, 0, [1.0], lambda parts: parts, None)
        [1.0]
    """
    with _calls:
        number = _seen.get((count, position), 0)
        _seen[(count, position)] = number + 1
        call = _open.setdefault((count, number), _Call(count))
        call.parts[position] = values
        last = len(call.parts) == count
        deadline = None if timeout is None else time.monotonic() + timeout
        while not last and len(call.parts) < count:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = sorted(set(range(count)) - set(call.parts))
                raise DeadlineExceededError(
                    f"ms.nn's gradient all-reduce inside shard_map or pmap: devices {missing} "
                    f"of {count} did not reach call {number + 1} within timeout_seconds="
                    f"{timeout:g} (does the call sit in a branch that some devices skip?)")
            _calls.wait(left)
    if last:
        try:
            result, error = list(reduce([call.parts[p] for p in range(count)])), None
        except BaseException as err:  # noqa: BLE001 - raised on every device's thread below
            result, error = None, err
        with _calls:
            call.result, call.error, call.done = result, error, True
            _calls.notify_all()
    with _calls:
        while not call.done:
            _calls.wait()
        call.left -= 1
        if call.left == 0:
            del _open[(count, number)]
    if call.error is not None:
        raise call.error
    return call.result[position]
