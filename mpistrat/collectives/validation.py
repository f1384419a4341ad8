"""Before a collective, ranks agree on what they are about to combine.

Each rank reduces its *signature* (kind of collective, op, dtype and shape
of every tensor) to a 64-bit hash, cached per signature, and one tiny
``Allreduce`` (MAX of ``h`` and of ``-h``) tells every rank whether all hashes
are equal. Only on a mismatch do ranks exchange the signatures themselves, to
build an error that names the ranks and what differs. The cost is one
16-byte ``Iallreduce`` per collective (about 5 µs on 2 ranks here); set
``MPISTRAT_VALIDATE=0`` to skip it.

    >>> from mpistrat.collectives.validation import describe_mismatch
    >>> print(describe_mismatch("all_reduce SUM",
    ...     [(("float32", (3,)),), (("float32", (4,)),)]))
    all_reduce SUM: ranks disagree on tensor 0: rank 0 has float32[3]; rank 1 has float32[4]
"""

import hashlib
from array import array
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from mpistrat.collectives.deadline import Deadline, wait_all
from mpistrat.errors import InvalidArgumentError

__all__ = ["Signature", "validation_enabled", "agree", "start_agree", "describe_mismatch", "format_ranks"]

Signature = Tuple[Tuple[str, Tuple[int, ...]], ...]
_HASHES: Dict[tuple, int] = {}


def validation_enabled() -> bool:
    """Whether cross-rank validation is on (``MPISTRAT_VALIDATE``, default on)."""
    return os.environ.get("MPISTRAT_VALIDATE", "1").strip().lower() not in ("0", "false", "no", "off")


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
    return f"{name} {note}" if note else name


def _describe_tensor(entry) -> str:
    if entry is None:
        return "nothing"
    dtype, shape = entry
    dtype = _dtype_name(dtype)
    return f"{dtype}[{','.join('?' if d < 0 else str(d) for d in shape)}]"


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
          deadline: Optional[Deadline]) -> None:
    """Raise ``InvalidArgumentError`` on every rank unless all ranks pass the same signature.

    The probe is always a non-blocking ``Iallreduce`` (MPI never matches a
    blocking collective with a non-blocking one), and the hash includes
    whether the collective that follows is timed: timed collectives use the
    non-blocking calls, untimed ones the blocking calls, so ranks must agree.
    """
    start_agree(comm, what, signature, deadline)()


def start_agree(comm: MPI.Comm, what: str, signature: Signature,
                deadline: Optional[Deadline]) -> Callable[[], None]:
    """``agree`` in two halves: post the probe now, and return the function that
    waits for it (and raises on a mismatch), so the caller can work meanwhile."""
    timed = deadline is not None
    h = _hash((what, signature, timed))
    probe = array("q", (h, -h))
    result = array("q", (0, 0))
    request = comm.Iallreduce(probe, result, MPI.MAX)

    def finish(buffers=(probe, result)) -> None:  # the buffers live until the wait ends
        if deadline is None:
            request.Wait()
        else:
            wait_all([request], deadline, f"{what} (validation)")
        if result[0] != -result[1]:  # max(h) == min(h) would mean every rank passed the same
            _raise_mismatch(comm, what, signature, timed)

    return finish


def _raise_mismatch(comm: MPI.Comm, what: str, signature: Signature, timed: bool) -> None:
    everyone = comm.allgather((what, signature, timed))  # small metadata, error path only
    kinds = {w for w, _, _ in everyone}
    if len(kinds) > 1:
        names = "; ".join(f"rank {r} calls {w}" for r, (w, _, _) in enumerate(everyone))
        raise InvalidArgumentError(f"ranks are in different collectives: {names}")
    if len({t for _, _, t in everyone}) > 1:
        timed_ranks = [r for r, (_, _, t) in enumerate(everyone) if t]
        raise InvalidArgumentError(
            f"{what}: only {format_ranks(timed_ranks)} set a collective timeout; give every "
            f"rank the same CommunicationOptions.timeout_seconds / MPISTRAT_COLLECTIVE_TIMEOUT")
    raise InvalidArgumentError(describe_mismatch(what, [sig for _, sig, _ in everyone]))
