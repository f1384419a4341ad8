"""Every rank must name the same checkpoint path: one checkpoint is written by all ranks together.

TensorFlow's multi-worker tutorials give each non-chief worker its own
temporary directory (``write_filepath``, ``workertemp_<task_id>``), because
there every worker writes a whole checkpoint of its own. Here all ranks write
(and read) one checkpoint together, so the paths must agree; a program that
passes different ones gets an error naming each rank's path, on every rank,
before anything is written or read. The check rides on the agreement the
checkpoint makes anyway (``agree_view_at``: no extra collective when the ranks
agree)::

    >>> from mpistrat.checkpoint.same_path import describe_paths
    >>> describe_paths(["/run/ckpt", "/run/workertemp_1/ckpt"])
    'rank 0: /run/ckpt; rank 1: /run/workertemp_1/ckpt'
"""

import hashlib
import inspect
import os
from typing import Any, List, Optional

import numpy as np

from mpistrat.collectives import CollectiveEngine
from mpistrat.collectives.agreement import agree_view, describe_views
from mpistrat.errors import InvalidArgumentError, NotFoundError

__all__ = ["agree_path", "agree_view_at", "describe_paths"]

_SHARED_HINT = inspect.signature(agree_view).parameters["hint"].default


def describe_paths(paths: List[str]) -> str:
    """``rank r: path`` for each rank, ranks with the same path grouped (pure)."""
    groups: dict = {}
    for rank, path in enumerate(paths):
        groups.setdefault(path, []).append(rank)
    parts = []
    for path, ranks in groups.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
        parts.append(f"{label}: {path}")
    return "; ".join(parts)


def agree_path(engine: CollectiveEngine, path: str, what: str) -> None:
    """``InvalidArgumentError`` on every rank unless all ranks passed the same ``path``
    (compared as absolute paths, so ranks with different working directories differ too).

    Collective and cheap: one small all-reduce of a digest; the paths are gathered
    only when they differ.
    """
    if engine.size == 1:
        return
    absolute = os.path.abspath(os.fspath(path))
    digest = int.from_bytes(hashlib.blake2b(absolute.encode(), digest_size=8).digest(),
                            "little") >> 2
    low_high = engine.all_reduce(np.array([digest, -digest], dtype=np.int64), "MAX")
    if low_high[0] == -low_high[1]:
        return
    seen = engine.allgather_object((os.fspath(path), absolute), f"{what}: the ranks' paths")
    raise _different_paths(what, [g for g, _ in seen], [a for _, a in seen])


def _different_paths(what: str, given: List[str], absolutes: List[str]) -> InvalidArgumentError:
    shown = [g if g == a else f"{g} (= {a})" for g, a in zip(given, absolutes)]
    return InvalidArgumentError(
        f"{what}: the ranks passed different checkpoint paths ({describe_paths(shown)}). All "
        f"ranks write one checkpoint together, so every rank must pass the same path (rank 0's "
        f"is the one to keep); TensorFlow's per-worker temporary directories (write_filepath, "
        f"workertemp_<task_id>) are not needed here: pass the chief's path on every rank")


def agree_view_at(engine: CollectiveEngine, path: str, view: Any, what: str, action: str,
                  error=NotFoundError, hint: Optional[str] = None) -> Any:
    """``agree_view(engine, view, what)`` with ``path`` folded into the same collective.

    When the ranks agree this costs what ``agree_view`` costs. When they do not,
    every rank learns why together: different paths raise ``InvalidArgumentError``
    naming each rank's path (``action`` says what was being done); the same path
    seen differently raises ``error`` as ``agree_view`` does.
    """
    absolute = os.path.abspath(os.fspath(path))
    try:
        agree_view(engine, (absolute, view), what, error=error, hint=hint or _SHARED_HINT)
        return view
    except error:
        pass  # every rank is here: the paths or the views differ (gathered below)
    seen = engine.allgather_object((os.fspath(path), absolute, view), f"{action}: {what}")
    if len({a for _, a, _ in seen}) > 1:
        raise _different_paths(action, [g for g, _, _ in seen], [a for _, a, _ in seen])
    raise error(f"ranks see different things at {what}: "
                f"{describe_views([v for _, _, v in seen])}; {hint or _SHARED_HINT}")
