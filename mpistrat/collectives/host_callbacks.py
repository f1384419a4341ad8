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
import itertools
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from mpistrat.errors import DeadlineExceededError, InvalidArgumentError
from mpistrat.runtime import jax_threads

__all__ = ["TRACED", "traced", "running", "inside", "settle", "gathered", "site", "Site",
           "gathered_flat", "per_device_axes", "traced_at",
           "RENDEZVOUS_SECONDS"]

# Whether a collective was ever traced into a callback. Hot paths test it themselves
# (`if TRACED[0]: settle()`): one load when nothing was traced, no call.
TRACED = [False]
_local = threading.local()


def traced() -> None:
    """Note that a collective was traced into a host callback: from now on ``settle`` waits.
    Raises ``FailedPreconditionError`` where the callback could hang (``jax_threads``)."""
    jax_threads.check_pool()
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


# A device that never comes (a branch some devices skip) must not hold the others forever:
# without a collective timeout, the devices of one call wait this long for each other.
RENDEZVOUS_SECONDS = 300.0
_sites = itertools.count(1)


class Site:
    """One traced per-device callback (made when the callback is traced): only the devices'
    calls of the same ``Site`` meet. Numbered in trace order, so ranks that trace the same
    program in the same order number it alike; ``name`` is what errors call it."""

    __slots__ = ("number", "name")

    def __init__(self, name: str):
        self.number = next(_sites)
        self.name = f"{name} (callback #{self.number})"

    def __repr__(self) -> str:
        return f"Site({self.name!r})"


def site(name: str) -> Site:
    """A new call-site token for a per-device callback being traced (see ``gathered``)."""
    return Site(name)


class _Call:
    """One call of a per-device callback: each device's values, then the shared result."""

    def __init__(self, count: int):
        self.parts: Dict[int, list] = {}
        self.result: Optional[list] = None
        self.error: Optional[BaseException] = None
        self.done = False
        self.left = count   # devices yet to take their part


class _Gathering:
    """The calls of one callback on one device count: calls made per device, calls open, and
    the devices that missed a call that timed out (their late arrival raises)."""

    def __init__(self):
        self.seen: Dict[int, int] = {}      # position -> calls made so far
        self.open: Dict[int, _Call] = {}    # call number -> its gathering
        self.owed: Dict[int, str] = {}      # position -> why its late call fails


_calls = threading.Condition()
_gatherings: Dict[tuple, _Gathering] = {}   # (site, devices) -> its calls


def gathered(count: int, position: int, values: list,
             reduce: Callable[[List[list]], Sequence[list]], timeout: Optional[float],
             site: Optional[Site] = None) -> list:
    """Device ``position`` of ``count`` gives ``values`` to this call of a per-device callback
    and gets back its part of ``reduce(parts)`` (``parts``: every device's values in position
    order). Only calls of the same ``site`` (the traced callback) meet. The last device to
    come runs ``reduce`` on its thread, once; every device waits for it, at most ``timeout``
    seconds for the others to come (``None``: ``RENDEZVOUS_SECONDS``), then as long as
    ``reduce`` takes (its own deadline). An error of ``reduce`` is raised on every device's
    thread. Calls are counted per site and device: JAX runs one device's callbacks in
    program order, so the n-th call of a site on every device is one call. When the devices
    of a call do not all come in time, the call fails on those that came
    (``DeadlineExceededError`` naming the callback and the missing positions), the counts
    start again, and a missing device that comes later raises the same way instead of
    joining another call.

        >>> gathered(1, 0, [1.0], lambda parts: parts, None)
        [1.0]
    """
    if count == 1:   # nothing to meet
        return list(reduce([values]))[0]
    name = site.name if site is not None else "ms.nn's gradient all-reduce"
    with _calls:
        gathering = _gatherings.setdefault((site, count), _Gathering())
        late = gathering.owed.pop(position, None)
        if late is not None:
            raise DeadlineExceededError(late)
        number = gathering.seen.get(position, 0)
        gathering.seen[position] = number + 1
        call = gathering.open.setdefault(number, _Call(count))
        call.parts[position] = values
        last = len(call.parts) == count
        limit = timeout if timeout is not None else RENDEZVOUS_SECONDS
        deadline = time.monotonic() + limit
        while not last and len(call.parts) < count and not call.done:
            left = deadline - time.monotonic()
            if left <= 0:
                _fail(gathering, number, call, count, name, limit, timeout is None)
                break
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
        if call.left == 0 and gathering.open.get(number) is call:
            del gathering.open[number]
    if call.error is not None:
        raise call.error
    return call.result[position]


def gathered_flat(count: int, position: int, values: list,
                  reduce_flat: Callable[[list], Sequence], timeout: Optional[float],
                  site: Optional[Site] = None) -> list:
    """``gathered`` for a reduction of every device's values as one flat list (device 0's
    first), one result per value, run as a host callback's collective (``running``): device
    ``position`` gets back the results of its own values.

        >>> gathered_flat(1, 0, [1.0, 2.0], lambda flat: [2 * v for v in flat], None)
        [2.0, 4.0]
    """
    width = len(values)

    def reduce(parts):
        flat = [value for part in parts for value in part]
        with running():
            out = list(reduce_flat(flat))
        return [out[i * width:(i + 1) * width] for i in range(len(parts))]

    return gathered(count, position, values, reduce, timeout, site)


def _fail(gathering: _Gathering, number: int, call: _Call, count: int, name: str,
          limit: float, default: bool) -> None:
    """Call ``number`` timed out (under ``_calls``): it and every other open call of its
    gathering fail, the counts start again, its missing devices are owed an error."""
    missing = sorted(set(range(count)) - set(call.parts))
    why = ("the rendezvous limit host_callbacks.RENDEZVOUS_SECONDS (no timeout_seconds set)"
           if default else "timeout_seconds")
    call.error = DeadlineExceededError(
        f"{name}, inside shard_map or pmap: the devices at positions {missing} of the {count} "
        f"in this process's mesh did not reach call {number + 1} within {limit:g} s ({why}); "
        f"does the call sit in a branch that some devices skip (jax.lax.cond on a per-device "
        f"value)?")
    for other in gathering.open.values():
        if not other.done and len(other.parts) < count:   # (not one being reduced)
            other.error = other.error or call.error
            other.done = True
    late = (f"{name}, inside shard_map or pmap: this device (position {{}} of {count}) came to "
            f"call {number + 1} after it had failed: the devices at positions "
            f"{[p for p in range(count) if p in call.parts]} stopped waiting after {limit:g} s")
    for position in missing:
        gathering.owed[position] = late.format(position)
    gathering.seen.clear()
    gathering.open.clear()
    _calls.notify_all()


# -- where a traced callback runs, and who traced it -----------------------------------------
def per_device_axes(what: str) -> tuple:
    """The mesh axes over which a traced call runs once per device (inside ``shard_map`` or
    ``pmap``: all of the mesh's axes are manual), or ``()`` inside a plain ``jax.jit``, where
    the callback runs once; a ``ValueError`` where a host callback cannot run as the ranks'
    one collective."""
    import jax
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(getattr(mesh, "manual_axes", ()))
    if not manual:
        return ()
    if len(manual) != len(mesh.axis_names):
        raise InvalidArgumentError(
            f"{what} inside shard_map over the axes {list(manual)} of a mesh with the axes "
            f"{list(mesh.axis_names)}: JAX runs host callbacks only where every mesh axis is "
            f"manual; give shard_map all of the mesh's axes (axis_names=), or call {what} "
            f"outside shard_map, in the jitted function")
    if jax.process_count() > 1:
        raise InvalidArgumentError(
            f"{what} inside shard_map or pmap with jax.distributed initialized "
            f"({jax.process_count()} JAX processes): a mesh spanning processes reduces with "
            f"jax.lax.psum/pmean over its axes; {what} reduces over the ranks of "
            f"process-local meshes")
    return manual


_LIBRARIES = tuple(os.sep + name + os.sep for name in ("mpistrat", "jax", "jaxlib", "optax",
                                                      "flax", "keras", "equinox"))


def traced_at() -> str:
    """`` at file:line`` of the user's code tracing the call (for errors), or ``""``."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in _LIBRARIES) and not path.startswith("<frozen") \
                and os.path.basename(path) not in ("functools.py", "contextlib.py"):
            return f" at {os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""
