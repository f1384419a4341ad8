"""All-reduce algorithms on contiguous host buffers.

Algorithms, chosen by message size and topology (``choose_algorithm``, the
one place that picks):

* ``mpi``: the MPI library's own ``Allreduce`` (best for small messages, and
  across hosts when each host holds one rank).
* ``ring``: reduce-scatter then all-gather around a ring of ``Sendrecv``
  calls. Each rank sends ``2 (n-1)/n`` of the buffer and reduces only
  ``(n-1)/n`` of it, which beats Open MPI 4.1's default for messages of a few
  MiB and more on one host (docs/benchmarks.md); across hosts it loses.
* ``hierarchical``: reduce-scatter inside each node, all-reduce across nodes
  among the ranks owning the same part, all-gather inside each node
  (``backends/hierarchical.py``): only ``1/local_size`` of the buffer
  crosses host links per rank.
* ``reduce_broadcast``: ``Reduce`` to rank 0 then ``Bcast`` (TensorFlow's
  ``ReductionToOneDevice``), only when asked for.
* ``rabenseifner``: reduce-scatter by recursive halving, all-gather by
  recursive doubling: the ring's bytes in ``2 log2 n`` rounds instead of
  ``2 (n-1)`` (the simulation of many nodes calls for it, docs/scaling.md).

Our own algorithms run the steps of ``collectives/schedules.py`` (``play``),
the same steps the simulator (``mpistrat/simulate``) plays on a model of a
cluster. The chunk layout is a pure function, ``ring_chunks``::

    >>> from mpistrat.collectives.algorithms import ring_chunks
    >>> ring_chunks(10, 3)
    [(0, 4), (4, 7), (7, 10)]
"""

from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.buffer_pool import default_pool
from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.collectives.schedules import (FRESH, INPUT, PLACE, Step, rabenseifner_steps,
                                            ring_allreduce_steps,
                                            ring_all_gather_steps, ring_reduce_scatter_steps)
from mpistrat.partition import even_ranges
from mpistrat.runtime import timeline

__all__ = ["ring_chunks", "choose_algorithm", "explain_algorithm", "allreduce", "play",
           "compile_steps", "ring_reduce_scatter", "ring_all_gather", "recording",
           "RING_THRESHOLD_BYTES", "ALGORITHMS", "MESSAGE_ELEMENTS"]

ALGORITHMS = ("auto", "mpi", "ring", "hierarchical", "reduce_broadcast", "rabenseifner")

# Messages of at least this many bytes use the ring on one node (a negative value would turn
# it off; tests lower it): Open MPI 4.1's own Allreduce loses to it from a few MiB
# (docs/benchmarks.md). The tuning table (MPISTRAT_TUNING, docs/tuning.md) measures instead.
RING_THRESHOLD_BYTES = 1 << 20
# Across nodes, buffers of at least this many bytes take the hierarchical algorithm; smaller
# ones MPI's own: on real namespace hosts (2 x 2) hierarchical ran 0.64-0.77x raw at 64 MiB but
# 0.95-1.19x at 16 MiB, where both send the minimum bytes (docs/benchmarks.md).
HIERARCHICAL_THRESHOLD_BYTES = 32 << 20
# A buffer combined in place (a fused bucket, a reproducible sum's grid) on one node takes the
# ring only from this size: in place, MPI's own beat the ring from 1 to 16 MiB at 2 and 4 ranks
# on two machines, and lost at 64 MiB (docs/tuning.md).
IN_PLACE_RING_THRESHOLD_BYTES = 32 << 20
_RING_TAG = 0x7269
# The most elements one MPI message carries: MPI's counts are C ints. Larger buffers are
# combined and broadcast in pieces of this many elements (backends/host.py); tests lower it.
MESSAGE_ELEMENTS = (1 << 31) - 1

_COMBINE = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add,
            ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def ring_chunks(count: int, parts: int) -> List[Tuple[int, int]]:
    """The ring's chunks: ``count`` elements in ``parts`` contiguous ranges (``even_ranges``)."""
    return even_ranges(count, parts)


def choose_algorithm(nbytes: int, comm_size: int, threshold: Optional[int] = None,
                     topology=None, preference: str = "auto", in_place: bool = False) -> str:
    """The algorithm for one buffer: see ``explain_algorithm`` for the rules."""
    return explain_algorithm(nbytes, comm_size, threshold, topology, preference, in_place)[0]


def explain_algorithm(nbytes: int, comm_size: int, threshold: Optional[int] = None,
                      topology=None, preference: str = "auto", in_place: bool = False):
    """``(algorithm, why)`` for a buffer of ``nbytes`` over ``comm_size`` ranks.

    A ``preference`` other than ``"auto"`` (from ``cross_device_ops``) is
    honoured. Otherwise: one rank or a small buffer, ``mpi``; one node,
    ``ring``; two hosts of one rank each, ``mpi``; three or more hosts of one
    rank each, ``ring`` (it sends fewer bytes per host link than Open MPI's
    default there, measured on real hosts); several nodes with several ranks
    on some, ``hierarchical`` (the flat ring crosses each link with 1.5x the
    buffer at 2 x 2). ``threshold`` (``None``: ``RING_THRESHOLD_BYTES``, or on one node
    for a buffer combined ``in_place``, ``IN_PLACE_RING_THRESHOLD_BYTES``) is "small".

    >>> choose_algorithm(4 << 20, 2), choose_algorithm(4 << 20, 2, in_place=True)
    ('ring', 'mpi')

    >>> from mpistrat.collectives.topology import make_topology
    >>> choose_algorithm(64 << 20, 4, topology=make_topology([0, 0, 1, 1], [None] * 4))
    'hierarchical'
    >>> choose_algorithm(64 << 20, 2, topology=make_topology([0, 1], [None] * 2))
    'mpi'
    """
    if preference not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {preference!r}; use one of {ALGORITHMS}")
    if comm_size == 1:
        return "mpi", "one rank: nothing crosses a link"
    if preference != "auto":
        return preference, f"asked for ({preference}) by cross_device_ops"
    if threshold is None:
        one_node = topology is None or topology.num_nodes <= 1
        threshold = IN_PLACE_RING_THRESHOLD_BYTES if in_place and one_node else \
            RING_THRESHOLD_BYTES
    if threshold < 0 or nbytes < threshold:
        return "mpi", (f"{nbytes} B is below the {threshold} B threshold: MPI's own is "
                       f"fastest for small messages" if threshold >= 0 else "ring turned off")
    if topology is None or topology.num_nodes <= 1:
        return "ring", "one node: the ring beats Open MPI's default Allreduce for large buffers"
    if max(topology.node_sizes) == 1 and topology.num_nodes >= 3:
        return "ring", (f"{topology.describe()}: one rank per node on 3 or more hosts: the ring "
                        f"sends fewer bytes over each host link than Open MPI's default "
                        f"(measured on real hosts: 0.34-0.65x its time from 1 MiB)")
    if max(topology.node_sizes) == 1:
        return "mpi", (f"{topology.describe()}: two hosts of one rank: nothing to combine "
                       f"inside nodes, and the ring was no faster than MPI's own there")
    if nbytes < HIERARCHICAL_THRESHOLD_BYTES:
        return "mpi", (f"{topology.describe()}: below {HIERARCHICAL_THRESHOLD_BYTES} B MPI's own "
                       f"beats three steps")
    return "hierarchical", (f"{topology.describe()}: reduce inside nodes, only 1/local_size "
                            f"of the buffer per rank crosses host links")


def allreduce(comm: MPI.Comm, send: np.ndarray, recv: np.ndarray, op: ReduceOp,
              deadline: Optional[Deadline], algorithm: str) -> None:
    """Combine ``send`` across ``comm`` into ``recv`` (both contiguous, same shape).

    ``send`` may be ``recv`` itself (in place). Each call is one bucket span
    of the timeline when it records.
    """
    if timeline.ON:
        start = timeline.now()
        _allreduce(comm, send, recv, op, deadline, algorithm)
        timeline.note_algorithm(algorithm, recv.nbytes, start)
        return
    _allreduce(comm, send, recv, op, deadline, algorithm)


def _allreduce(comm, send, recv, op, deadline, algorithm):
    runner = _RUNNERS.get(algorithm)
    if runner is not None:
        runner(comm, send, recv, op, deadline)
        return
    _record_call(comm, "allreduce", recv.size)
    if send is recv:
        send = MPI.IN_PLACE
    if deadline is None:
        comm.Allreduce(send, recv, op.mpi_op)
    else:
        wait_all([comm.Iallreduce(send, recv, op.mpi_op)], deadline, f"all_reduce {op.name}")


def _exchange(comm, send, dest, recv, source, deadline, what):
    """Send ``send`` to ``dest`` and receive ``recv`` from ``source`` (either may be absent)."""
    if deadline is None:
        if send is not None and recv is not None:
            comm.Sendrecv(send, dest, _RING_TAG, recv, source, _RING_TAG)
        elif send is not None:
            comm.Send(send, dest, _RING_TAG)
        elif recv is not None:
            comm.Recv(recv, source, _RING_TAG)
        return
    requests = ([comm.Irecv(recv, source, _RING_TAG)] if recv is not None else []) + \
        ([comm.Isend(send, dest, _RING_TAG)] if send is not None else [])
    wait_all(requests, deadline, what)


def play(comm: MPI.Comm, steps: Sequence[Step], src: np.ndarray, out: np.ndarray, op: ReduceOp,
         deadline: Optional[Deadline], what: str) -> None:
    """Run one rank's ``steps`` (``collectives/schedules.py``) on flat ``src`` and ``out``.

    ``src`` is only read (it may be ``out`` itself); received elements are
    combined with ``op`` or placed, as each step says.
    """
    apart = not np.may_share_memory(src, out)   # (in place: views of one buffer)
    _play_moves(comm, compile_steps(steps, apart), src, out, op, deadline, what)


_DIRECT = "direct"   # a fresh combine received straight into its place


def compile_steps(steps: Sequence[Step], apart: bool) -> Tuple[tuple, int]:
    """``(moves, scratch elements)``: what ``play`` does at each step, decided once (pure).

    A move is ``(step, send, send from the input, recv, how)``; ``how`` is ``PLACE``,
    ``_DIRECT`` (out of place, a fresh combine receives straight into its place and
    combines there: no scratch pass, the memory traffic of in place), or ``FRESH`` /
    ``ACCUMULATE`` through a scratch buffer of the returned size.

    >>> from mpistrat.collectives.schedules import ring_allreduce_steps
    >>> moves, scratch = compile_steps(ring_allreduce_steps(0, 2, 8), apart=True)
    >>> [how for *_, how in moves], scratch
    (['direct', 'place'], 0)
    >>> compile_steps(ring_allreduce_steps(0, 2, 8), apart=False)[1]
    4
    """
    moves, scratch = [], 0
    for step in steps:
        send, recv = step.send, step.recv
        how = None
        if recv is not None:
            c, d = recv[1], recv[2]
            if step.combine == PLACE:
                how = PLACE
            elif apart and step.combine == FRESH and not (
                    send is not None and step.source != INPUT and send[1] < d and c < send[2]):
                how = _DIRECT
            else:   # (in place, an accumulate, or a fresh step that overlaps its send)
                how = step.combine
                scratch = max(scratch, d - c)
        moves.append((step, send, send is not None and step.source == INPUT, recv, how))
    return tuple(moves), scratch


# Compiled ring and Rabenseifner schedules, by (algorithm, rank, size, count, apart): a
# training loop reduces the same tensor sizes every step, and making the steps anew at each
# call cost more than two small exchanges.
_COMPILED: dict = {}
_STEPS = {"ring": ring_allreduce_steps, "rabenseifner": rabenseifner_steps}


def _compiled(algorithm: str, rank: int, size: int, count: int, apart: bool):
    key = (algorithm, rank, size, count, apart)
    plan = _COMPILED.get(key)
    if plan is None:
        if len(_COMPILED) >= 1024:
            _COMPILED.clear()
        plan = _COMPILED[key] = compile_steps(_STEPS[algorithm](rank, size, count), apart)
    return plan


def _play_moves(comm, compiled, src, out, op, deadline, what) -> None:
    """``play`` of compiled steps (``compile_steps``), receiving into leased scratch."""
    moves, need = compiled
    if not need:                                    # (empty receives)
        return _play_leased(comm, moves, src, out, op, deadline, what, out[:0])
    with default_pool().lease((need,), out.dtype) as scratch:
        return _play_leased(comm, moves, src, out, op, deadline, what, scratch)


def _play_leased(comm, moves, src, out, op, deadline, what, scratch) -> None:
    combine = _COMBINE[op]
    record = _recording
    ranks = _world_ranks(comm) if record is not None else None
    for step, send, from_input, recv, how in moves:
        if record is not None:
            record.append(_step_event(step, ranks))
        outgoing = None if send is None else (src if from_input else out)[send[1]:send[2]]
        if recv is None:
            _exchange(comm, outgoing, send and send[0], None, None, deadline, what)
            continue
        c, d = recv[1], recv[2]
        incoming = out[c:d] if how is PLACE or how is _DIRECT else scratch[:d - c]
        _exchange(comm, outgoing, send and send[0], incoming, recv[0], deadline, what)
        if how is _DIRECT:   # (the operands in the scratch path's order: MIN/MAX of -0.0, NaN)
            combine(src[c:d], incoming, out=incoming)
        elif how is not PLACE:
            combine((src if how == FRESH else out)[c:d], incoming, out=out[c:d])


def _schedule_allreduce(algorithm, comm, send, recv, op, deadline):
    """All-reduce by one of ``_STEPS``' schedules, compiled once per size (``_compiled``)."""
    src, out = send.reshape(-1), recv.reshape(-1)
    size = comm.Get_size()
    if size == 1:
        if src is not out:
            out[:] = src
        return
    compiled = _compiled(algorithm, comm.Get_rank(), size, src.size,
                         not np.may_share_memory(src, out))
    _play_moves(comm, compiled, src, out, op, deadline, f"{algorithm} all_reduce {op.name}")


def _ring_allreduce(comm, send, recv, op, deadline):
    """Reduce-scatter, then all-gather around the ring (``schedules.ring_allreduce_steps``:
    this rank's chunk complete, then every chunk everywhere)."""
    _schedule_allreduce("ring", comm, send, recv, op, deadline)


def _rabenseifner_allreduce(comm, send, recv, op, deadline):
    """Recursive halving reduce-scatter, then recursive doubling all-gather (``2 log2 n``
    rounds instead of the ring's ``2 (n-1)``, the same bytes)."""
    _schedule_allreduce("rabenseifner", comm, send, recv, op, deadline)


def ring_reduce_scatter(comm: MPI.Comm, src: np.ndarray, out: np.ndarray,
                        bounds: List[Tuple[int, int]], op: ReduceOp,
                        deadline: Optional[Deadline]) -> None:
    """Ring reduce-scatter of flat ``src`` into flat ``out`` (``src`` may be ``out``).

    ``bounds[r]`` is the contiguous range rank ``r`` owns (any partition, even
    uneven or empty parts); afterwards ``out[bounds[rank]]`` holds the
    combination over all ranks, and the rest of ``out`` partial results.
    Partial sums pass to the right; a chunk is complete after ``size - 1`` steps
    (``schedules.ring_reduce_scatter_steps``).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        a, b = bounds[0]
        if src is not out:
            out[a:b] = src[a:b]
        return
    play(comm, ring_reduce_scatter_steps(rank, size, bounds), src, out, op, deadline,
         f"ring reduce-scatter {op.name}")


def ring_all_gather(comm: MPI.Comm, buffer: np.ndarray, bounds: List[Tuple[int, int]],
                    deadline: Optional[Deadline]) -> None:
    """Ring all-gather in place: rank ``r`` contributes ``buffer[bounds[r]]``; complete
    chunks pass to the right, straight into place (``schedules.ring_all_gather_steps``)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    play(comm, ring_all_gather_steps(rank, size, bounds), buffer, buffer, ReduceOp.SUM,
         deadline, "ring all-gather")


# --- recording what a process plays (a test aid: tests/mpi/test_schedule_tie.py) ---

_recording: Optional[list] = None


@contextmanager
def recording():
    """Record every step and library collective this process plays, in ``COMM_WORLD`` ranks.

    Yields a list that fills with ``("step", send, recv, combine)`` (``send``
    and ``recv`` are ``(world rank, start, stop)`` or ``None``) and
    ``("call", kind, members, count)`` for the MPI library's own collectives.
    Off (one attribute test per call) unless inside this block.
    """
    global _recording
    events: list = []
    _recording = events
    try:
        yield events
    finally:
        _recording = None


def _world_ranks(comm) -> List[int]:
    return MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                     MPI.COMM_WORLD.Get_group())


def _step_event(step: Step, ranks: List[int]):
    send = None if step.send is None else (ranks[step.send[0]],) + step.send[1:]
    recv = None if step.recv is None else (ranks[step.recv[0]],) + step.recv[1:]
    return ("step", send, recv, step.combine)


def _record_call(comm, kind: str, count: int) -> None:
    if _recording is not None:
        _recording.append(("call", kind, tuple(_world_ranks(comm)), count))


def _reduce_broadcast(comm, send, recv, op, deadline):
    """TensorFlow's ``ReductionToOneDevice``: reduce to rank 0, then broadcast from it."""
    what = f"reduce_broadcast all_reduce {op.name}"
    _record_call(comm, "reduce", recv.size)
    _record_call(comm, "bcast", recv.size)
    if comm.Get_rank() == 0:
        source = MPI.IN_PLACE if send is recv else send
    else:
        source = send
    if deadline is None:
        comm.Reduce(source, recv if comm.Get_rank() == 0 else None, op.mpi_op, root=0)
        comm.Bcast(recv, root=0)
    else:
        wait_all([comm.Ireduce(source, recv if comm.Get_rank() == 0 else None, op.mpi_op,
                               root=0)], deadline, what)
        wait_all([comm.Ibcast(recv, root=0)], deadline, what)


# Algorithms run by our own schedules, by name (``mpi`` is the library's ``Allreduce``; the
# hierarchical algorithm runs from backends/host.py, which knows the topology).
_RUNNERS = {"ring": _ring_allreduce, "rabenseifner": _rabenseifner_allreduce,
            "reduce_broadcast": _reduce_broadcast}
