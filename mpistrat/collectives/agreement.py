"""Agreement among ranks: one rank's failure, or differing views, raise on every rank.

Every decision about files (does it exist, what does the state file say, did
a write or a read succeed) is taken by each rank and then agreed with one
small all-reduce (which honours the collective timeout); only when something
differs are the texts gathered. So ranks with different views of the file
system, or a rank whose write or read failed, make every rank raise the same
error together instead of leaving some waiting in the next collective.

    >>> from mpistrat.collectives.agreement import describe_views
    >>> describe_views(["file", "file", "missing"])
    'ranks 0-1: file; rank 2: missing'
"""

import builtins
import contextlib
import errno as errno_codes
import hashlib
from typing import Any, Iterator, List, Optional, Sequence, Type

import numpy as np

from mpistrat.collectives.objects import allgather_object
from mpistrat import errors
from mpistrat.errors import NotFoundError

__all__ = ["Failure", "agreed", "agree_errors", "agree_view", "describe_views", "rank_list",
           "views_differ"]


class Failure:
    """One rank's failure, sent to the others: the error class, errno and text."""

    __slots__ = ("kind", "errno", "text")

    def __init__(self, err: BaseException, rank: int, what: str = ""):
        self.kind = type(err).__name__
        self.errno = getattr(err, "errno", None)
        self.text = f"rank {rank}: {what}{': ' if what else ''}{type(err).__name__}: {err}"

    def __getstate__(self):
        return (self.kind, self.errno, self.text)

    def __setstate__(self, state):
        self.kind, self.errno, self.text = state


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2`` or ``ranks 0, 2``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def describe_views(views: Sequence[Any]) -> str:
    """Group ranks by what they saw: ``ranks 0-1: file; rank 2: missing``."""
    groups: dict = {}
    for rank, view in enumerate(views):
        groups.setdefault(repr(view) if not isinstance(view, str) else view, []).append(rank)
    return "; ".join(f"{rank_list(r)}: {v}" for v, r in groups.items())


_CLASSES = {name: getattr(errors, name) for name in errors.__all__
            if isinstance(getattr(errors, name), type)}   # ms.errors keep their class
_CLASSES["ValueError"] = ValueError


def agree_errors(engine: "CollectiveEngine", failure: Optional[Failure], what: str,
                 hint: str = "") -> None:
    """Raise the same error on every rank if any rank failed (collective).

    The class follows the first failure: the ``ms.errors`` classes (``DataLossError``,
    ``InvalidArgumentError``, ...) and ``ValueError`` as they are; an error with an errno becomes an
    ``OSError`` keeping it (``err.errno == errno.ENOSPC`` for a full disk);
    other builtin errors keep their class; anything else is a ``RuntimeError``.
    """
    if not _anyone(engine, failure is not None):
        return
    failures: List[Failure] = [f for f in allgather_object(engine, failure, what)
                               if f is not None]
    first = failures[0]
    text = f"{what} failed: " + "; ".join(f.text for f in failures) + (f"; {hint}" if hint else "")
    if first.kind in _CLASSES:
        raise _CLASSES[first.kind](text)
    if first.errno is not None:
        raise OSError(first.errno, f"{text}{_errno_hint(first.errno)}")
    builtin = getattr(builtins, first.kind, None)  # KeyError, TypeError, ... keep their class
    cls: Type[BaseException] = builtin if isinstance(builtin, type) and \
        issubclass(builtin, Exception) and builtin.__init__ is not OSError.__init__ else RuntimeError
    raise cls(text)


@contextlib.contextmanager
def agreed(engine: "CollectiveEngine", what: str, doing: str = "", hint: str = "") -> Iterator[None]:
    """Run the body on every rank, then raise the same error on every rank if any rank's
    body raised (collective: every rank enters and leaves it, whatever happened)::

        with engine.agreed(f"saving checkpoint {path}", doing="preparing the directory"):
            if engine.rank == 0:
                os.makedirs(directory, exist_ok=True)

    The error's class and text are ``agree_errors``'s (``what`` failed: each failing rank
    and ``doing``); on a rank that failed, its own exception is the cause.
    """
    local: Optional[Exception] = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - agreed with the other ranks, then raised
        local = err
    try:
        agree_errors(engine, None if local is None else Failure(local, engine.rank, doing),
                     what, hint)
    except Exception as shared:
        raise shared from local


def _anyone(engine: "CollectiveEngine", flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (an all-reduce that honours the collective timeout,
    so a rank that stopped answering ends in ``DeadlineExceededError`` instead of a hang)."""
    return bool(engine.all_reduce(np.array([int(flag)], dtype=np.int64), "MAX")[0])


def _errno_hint(code: int) -> str:
    if code in (errno_codes.ENOSPC, errno_codes.EDQUOT):
        return " (the file system is full or over quota: free space or choose another directory)"
    if code == errno_codes.EFBIG:
        return " (a file size limit, ulimit -f, is below the checkpoint's size)"
    if code in (errno_codes.EROFS, errno_codes.EACCES, errno_codes.EPERM):
        return " (the directory is not writable)"
    return ""


def views_differ(engine: "CollectiveEngine", view: Any) -> bool:
    """Whether any two ranks hold different ``view``s (one all-reduce of a digest of its
    ``repr``; collective, within the collective timeout)."""
    digest = int.from_bytes(hashlib.blake2b(repr(view).encode(), digest_size=8).digest(),
                            "little") >> 2
    low_high = engine.all_reduce(np.array([digest, -digest], dtype=np.int64), "MAX")
    return low_high[0] != -low_high[1]   # max != min


def agree_view(engine: "CollectiveEngine", view: Any, what: str, error=NotFoundError,
               hint: str = "put checkpoints on a file system that every rank shares") -> Any:
    """The view every rank has of something (collective); ranks that differ raise together."""
    if not views_differ(engine, view):
        return view
    views = allgather_object(engine, view, what)
    if any(v != views[0] for v in views[1:]):
        raise error(f"ranks see different things at {what}: {describe_views(views)}; {hint}")
    return views[0]
