"""Before a collective, ranks agree on what they are about to combine.

Each rank reduces its *signature* (kind of collective, op, dtype and shape
of every tensor) and the *path* it chose to run it (``allreduce_ops``: the op
and the settings that steer it) to a 64-bit hash, cached per signature, and one tiny
``Iallreduce`` tells every rank whether all hashes are equal: 16 doubles
summed, six of which carry three 16-bit pieces of the hash and their squares
(equal sums of pieces and of squares mean every rank sent the same pieces).
The other ten may carry a small float64 payload, so a validated scalar
all-reduce is one collective, not a probe and then a reduction (``Probe``).
Only on a mismatch do ranks exchange the signatures themselves, to build an
error that names the ranks and what differs. Set ``MPISTRAT_VALIDATE=0`` to
skip the probe for larger collectives.

    >>> from mpistrat.collectives.validation import describe_mismatch
    >>> print(describe_mismatch("all_reduce SUM",
    ...     [(("float32", (3,)),), (("float32", (4,)),)]))
    all_reduce SUM: ranks disagree on tensor 0: rank 0 has float32[3]; rank 1 has float32[4]
"""

import hashlib
from array import array
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.collectives.dtypes import dtype_code
from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.errors import InvalidArgumentError
from mpistrat.runtime import settings

__all__ = ["Signature", "validation_enabled", "agree", "start_agree", "Probe", "PAYLOAD_SLOTS",
           "FOLDABLE", "fold_result",
           "describe_mismatch", "format_ranks"]

Signature = Tuple[Tuple[str, Tuple[int, ...]], ...]
_HASHES: Dict[tuple, int] = {}


def validation_enabled() -> bool:
    """Whether cross-rank validation is on (``MPISTRAT_VALIDATE``, default on)."""
    return settings.get("MPISTRAT_VALIDATE")


_MAX_CACHED = 4096  # signatures remembered; a program with ever-new shapes cannot grow it


def _hash(key: tuple) -> int:
    value = _HASHES.get(key)
    if value is None:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little", signed=True) >> 1  # room to negate
        if len(_HASHES) >= _MAX_CACHED:
            _HASHES.clear()
        _HASHES[key] = value
    return value


def format_ranks(ranks: Sequence[int]) -> str:
    """``[1]`` -> ``'rank 1'``, ``[0, 2]`` -> ``'ranks 0, 2'``."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _dtype_name(code: str) -> str:
    """``'<f4'`` -> ``'float32'``; other text (already a name, or a note) unchanged."""
    head, _, note = code.partition(" ")
    try:
        name = np.dtype(head).name
    except TypeError:
        return code
    if not np.dtype(head).isnative:
        name += f" ({head[0]} byte order)"
    return f"{name} {note}" if note else name


def _describe_tensor(entry) -> str:
    """``float64[3]``, ``float64[?,3]`` (rows may differ), ``float32[2] (jax array)``."""
    if entry is None:
        return "nothing"
    dtype, shape = entry
    dtype, _, kind = dtype.partition("@")
    kind, _, note = kind.partition(" ")
    dtype = _dtype_name(dtype + (f" {note}" if note else ""))
    text = f"{dtype}[{','.join('?' if d < 0 else str(d) for d in shape)}]"
    return f"{text} ({kind} array)" if kind else text


def describe_mismatch(what: str, signatures: Sequence[Signature]) -> str:
    """Name the first tensor on which ranks differ and which rank has what (pure)."""
    counts = {len(sig) for sig in signatures}
    if len(counts) > 1:
        groups: Dict[int, List[int]] = {}
        for rank, sig in enumerate(signatures):
            groups.setdefault(len(sig), []).append(rank)
        parts = [f"{format_ranks(r)} pass{'es' if len(r) == 1 else ''} {n} tensors"
                 for n, r in groups.items()]
        return f"{what}: ranks disagree on the number of tensors: " + "; ".join(parts)
    length = counts.pop() if counts else 0
    for index in range(length):
        entries = [sig[index] for sig in signatures]
        if len(set(entries)) > 1:
            groups2: Dict[tuple, List[int]] = {}
            for rank, entry in enumerate(entries):
                groups2.setdefault(entry, []).append(rank)
            parts = [f"{format_ranks(r)} {'has' if len(r) == 1 else 'have'} {_describe_tensor(e)}"
                     for e, r in groups2.items()]
            return f"{what}: ranks disagree on tensor {index}: " + "; ".join(parts)
    return f"{what}: ranks disagree on the collective itself (kind or op)"


def agree(comm: MPI.Comm, what: str, signature: Signature,
          deadline: Optional[Deadline], path: str = "") -> None:
    """Raise ``InvalidArgumentError`` on every rank unless all ranks pass the same signature.

    The probe is always a non-blocking ``Iallreduce`` (MPI never matches a
    blocking collective with a non-blocking one), and the hash includes
    whether the collective that follows is timed: timed collectives use the
    non-blocking calls, untimed ones the blocking calls, so ranks must agree. ``path``
    names how the collective will run (the dispatcher's op); ranks that chose different
    paths would pair different MPI calls, so they raise too, naming each rank's path.
    """
    start_agree(comm, what, signature, deadline, path)()


# The probe: PROBE_SLOTS doubles summed across ranks. The last six carry three 16-bit
# pieces p of the signature's hash and their squares: every rank finds sum(p) == n * p
# and sum(p * p) == n * p * p (exact in doubles) only if every rank sent the same p.
# The first PAYLOAD_SLOTS may carry a small float64 SUM, so that a scalar all-reduce
# is one collective, not a probe and a reduction (``Probe.sum_with``).
PROBE_SLOTS = 16
PAYLOAD_SLOTS = PROBE_SLOTS - 6
_TEMPLATES: Dict[tuple, Tuple[array, array]] = {}


def _template(what: str, signature: Signature, timed: bool, size: int,
              path: str = "") -> Tuple[array, array]:
    """(the probe with zero payload, the hash slots every rank expects back), cached."""
    key = (what, signature, timed, size, path)
    entry = _TEMPLATES.get(key)
    if entry is None:
        if len(_TEMPLATES) > 4096:
            _TEMPLATES.clear()
        h = _hash((what, _plain(signature), timed, path))  # the same whichever dtype form
        parts = [(h >> shift) & 0xFFFF for shift in (0, 16, 32)]
        slots = [float(v) for p in parts for v in (p, p * p)]
        entry = (array("d", [0.0] * PAYLOAD_SLOTS + slots), array("d", [size * v for v in slots]))
        _TEMPLATES[key] = entry
    return entry


def start_agree(comm: MPI.Comm, what: str, signature: Signature,
                deadline: Optional[Deadline], path: str = "") -> Callable[[], None]:
    """``agree`` in two halves: post the probe now, and return the function that
    waits for it (and raises on a mismatch), so the caller can work meanwhile."""
    timed = deadline is not None
    template, expected = _template(what, signature, timed, comm.Get_size(), path)
    probe = array("d", template)
    result = array("d", template)
    request = comm.Iallreduce(probe, result, MPI.SUM)

    def finish(buffers=(probe, result)) -> None:  # the buffers live until the wait ends
        if deadline is None:
            request.Wait()
        else:
            wait_all([request], deadline, f"{what} (validation)")
        if result[PAYLOAD_SLOTS:] != expected:
            _raise_mismatch(comm, what, signature, timed, path)

    return finish


class Probe:
    """One engine's reusable probe buffers, for the validated small float64 SUM."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.size = comm.Get_size()
        self.send = array("d", [0.0] * PROBE_SLOTS)
        self.recv = array("d", [0.0] * PROBE_SLOTS)
        self.send_values = np.frombuffer(self.send, dtype=np.float64)
        self.recv_values = np.frombuffer(self.recv, dtype=np.float64)

    def sum_with(self, what: str, signature: Signature, deadline: Optional[Deadline],
                 values: np.ndarray, path: str = "") -> np.ndarray:
        """Validate and SUM up to ``PAYLOAD_SLOTS`` float64 values in one collective.

        Returns a view of the sums (valid until the next call)."""
        template, expected = _template(what, signature, deadline is not None, self.size, path)
        send = self.send
        send[:] = template
        count = values.size
        self.send_values[:count] = values.reshape(-1)
        request = self.comm.Iallreduce(send, self.recv, MPI.SUM)
        if deadline is None:
            request.Wait()
        else:
            wait_all([request], deadline, f"{what} (validation)")
        if self.recv[PAYLOAD_SLOTS:] != expected:
            _raise_mismatch(self.comm, what, signature, deadline is not None, path)
        return self.recv_values[:count]

    def ready(self, what: str, signature: Signature, timed: bool = False,
              path: str = "") -> Tuple[array, array, str]:
        """A probe of ``what``, ``signature`` and ``path`` to pass to ``sum_ready``, the hash
        slots every rank expects back, and the path; ``timed``: it will be waited for with a
        deadline (the hash says so, as the long path's does)."""
        template, expected = _template(what, signature, timed, self.size, path)
        return array("d", template), expected, path

    def sum_values(self, ready: Tuple[array, array, str], what: str, signature: Signature,
                   values: Sequence[float], deadline: Optional[Deadline] = None) -> array:
        """``sum_ready`` for a few values (at most ``PAYLOAD_SLOTS``): their sums (a copy)."""
        send = ready[0]
        for index, value in enumerate(values):
            send[index] = value
        return self.exchange(ready, what, signature, deadline)[:len(values)]

    def sum_ready(self, ready: Tuple[array, array, str], what: str, signature: Signature,
                  value: float, deadline: Optional[Deadline] = None) -> float:
        """The SUM over ranks of one float in a ``ready`` probe, validated (one collective)."""
        ready[0][0] = value
        return self.exchange(ready, what, signature, deadline)[0]

    def exchange(self, ready: Tuple[array, array, str], what: str, signature: Signature,
                 deadline: Optional[Deadline] = None) -> array:
        """One ``Iallreduce`` of a ``ready`` probe (waited for within ``deadline``, made
        ``timed`` then); the received probe, its hash slots checked (a mismatch raises on
        every rank, naming what each rank called)."""
        send, expected, path = ready
        recv = self.recv
        request = self.comm.Iallreduce(send, recv, MPI.SUM)
        if deadline is None:
            request.Wait()
        else:
            wait_all([request], deadline, f"{what} (validation)")
        if recv[PAYLOAD_SLOTS:] != expected:
            _raise_mismatch(self.comm, what, signature, deadline is not None, path)
        return recv


# Dtypes whose values, and sums of them over any realistic number of ranks, float64 holds
# exactly: small SUM/MEAN of these ride in the validation probe (``Probe``), one collective.
FOLDABLE = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8,
                                            np.int16, np.int32, np.uint8, np.uint16, np.uint32))
_FLOAT64 = np.dtype(np.float64)


def fold_result(total: np.ndarray, op: ReduceOp, size: int, dtype) -> np.ndarray:
    """A folded sum (float64, exact for ``FOLDABLE`` values) as ``dtype``: a MEAN divides
    first (integers truncate toward zero), then one rounding."""
    if op is ReduceOp.MEAN:
        if dtype.kind in "iu":  # (|sum| < size * 2**32: the quotient truncates exactly)
            total = np.trunc(total / size)
        else:
            total /= size
    if dtype.kind in "iu":  # an exact integer: a SUM beyond the dtype wraps, as MPI's does
        return total.astype(np.int64).astype(dtype)
    return total if dtype == _FLOAT64 else total.astype(dtype)


def _plain(signature) -> Signature:
    """Entries as ``(dtype string, shape)``, whichever dtype form the caller used."""
    return tuple((d if isinstance(d, str) else dtype_code(d), tuple(s)) for d, s in signature)


def _raise_mismatch(comm: MPI.Comm, what: str, signature: Signature, timed: bool,
                    path: str = "") -> None:
    everyone = comm.allgather((what, _plain(signature), timed, path))  # error path only
    kinds = {w for w, _, _, _ in everyone}
    if len(kinds) > 1:
        names = "; ".join(f"rank {r} calls {w}" for r, (w, _, _, _) in enumerate(everyone))
        raise InvalidArgumentError(f"ranks are in different collectives: {names}")
    if len({t for _, _, t, _ in everyone}) > 1:
        timed_ranks = [r for r, (_, _, t, _) in enumerate(everyone) if t]
        raise InvalidArgumentError(
            f"{what}: only {format_ranks(timed_ranks)} set a collective timeout; give every "
            f"rank the same CommunicationOptions.timeout_seconds / MPISTRAT_COLLECTIVE_TIMEOUT")
    if len({s for _, s, _, _ in everyone}) > 1:
        raise InvalidArgumentError(describe_mismatch(what, [sig for _, sig, _, _ in everyone]))
    names = "; ".join(f"rank {r} calls {what} via {p or 'its own path'}"
                      for r, (_, _, _, p) in enumerate(everyone))
    raise InvalidArgumentError(
        f"ranks are in different collectives: {names} (give every rank the same "
        f"CommunicationOptions and MPISTRAT_* settings)")
