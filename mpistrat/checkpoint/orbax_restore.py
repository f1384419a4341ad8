"""Restoring a step of the Orbax face: its manifest agreed, each item read and rebuilt.

Every check is made on every rank and agreed before a byte of data is read: the step exists
and is ours (its manifest), each item's file is complete and holds exactly the values its
manifest names, and a target tree fits the saved values (``ValueError`` naming the path).
Values are then read as ``ms.Checkpoint`` reads them (collectively, checksums verified).

    >>> from mpistrat.checkpoint.orbax_restore import agreed
    >>> from mpistrat.checkpoint.directory import io_engine
    >>> with agreed(io_engine(), "nothing failed"):
    ...     pass
"""

import contextlib
import os
from typing import Any, Dict, Iterator

from mpistrat.checkpoint.args import OrbaxNotSupportedError
from mpistrat.checkpoint.files import data_file, local_view
from mpistrat.checkpoint.h5read import Reader, read_catalog, read_values
from mpistrat.checkpoint.matching import read_batches
from mpistrat.checkpoint.orbax_steps import MANIFEST, foreign_hint, read_manifest
from mpistrat.checkpoint.orbax_tree import (check_target, rebuild_target, saved_leaves,
                                            saved_tree, target_leaves)
from mpistrat.collectives.agreement import agree_view
from mpistrat.errors import DataLossError, NotFoundError

__all__ = ["agreed", "agreed_manifest", "read_item"]


@contextlib.contextmanager
def agreed(engine, what: str) -> Iterator[None]:
    """``engine.agreed(what)`` (a failure on any rank raises on every rank), keeping an
    ``OrbaxNotSupportedError`` one (a ``NotImplementedError``) on every rank."""
    try:
        with engine.agreed(what):
            yield
    except RuntimeError as err:
        if "OrbaxNotSupportedError: " in str(err):
            raise OrbaxNotSupportedError(str(err)) from None
        raise


def agreed_manifest(engine, path: str, step: int) -> dict:
    """The manifest of step directory ``path``, read by every rank and agreed: a missing
    step raises ``NotFoundError``, one that is not ours or is damaged ``DataLossError``."""
    manifest, view = None, ("missing",)
    if os.path.islink(path) or os.path.lexists(path) and not os.path.isdir(path):
        view = ("foreign", f"{path} is not a directory (or is a symbolic link), so not a "
                           f"checkpoint step")
    elif os.path.lexists(path):
        try:
            digest, manifest = read_manifest(path, step)
            view = ("ok", digest)
        except FileNotFoundError:
            view = ("foreign", f"{path} is not a complete mpistrat checkpoint step (it has "
                               f"no {MANIFEST}){foreign_hint(path)}")
        except (DataLossError, OSError) as err:
            view = ("damaged", str(err))
    view = agree_view(engine, view, f"checkpoint step {path}", error=DataLossError)
    if view[0] == "missing":
        raise NotFoundError(f"Checkpoint at {path} not found.")
    if view[0] != "ok":
        raise DataLossError(view[1])
    return manifest

def read_item(engine, path: str, name: str, structure: dict, target: Any,
              partial: bool) -> Any:
    """Item ``name`` of step directory ``path``: as saved (``target`` is ``None``) or shaped
    like ``target`` (checked first on every rank, then agreed); ``partial``: the target may
    leave saved values out. Collective."""
    final = data_file(os.path.join(path, name))
    if agree_view(engine, local_view(final), final, error=DataLossError) != "file":
        raise DataLossError(f"{path}: its manifest names item {name!r} but {final} is "
                            f"missing: the step directory is damaged")
    catalog = read_catalog(final, engine)
    saved = saved_leaves(structure, final)
    if set(saved) != set(catalog):
        raise DataLossError(f"{final} does not hold the values its manifest names (paths "
                            f"{sorted(set(saved) ^ set(catalog))[:5]} differ)")
    wanted = sorted(saved)
    with agreed(engine, f"restoring {final}"):
        if target is not None:
            leaves = target_leaves(target)
            missing, extra = set(leaves) - set(saved), set(saved) - set(leaves)
            if missing:
                raise ValueError(f"cannot restore {final}: it holds no value for the "
                                 f"target's {sorted(missing)[:10]}")
            if extra and not partial:
                raise ValueError(f"cannot restore {final}: the target leaves out saved "
                                 f"values {sorted(extra)[:10]}; pass the saved structure, "
                                 f"or PyTreeRestore(target, partial_restore=True)")
            for leaf_path, leaf in sorted(leaves.items()):
                check_target(leaf, catalog[leaf_path], leaf_path, final)
            wanted = sorted(leaves)
    agree_view(engine, wanted, f"the values to restore from {final}", error=ValueError,
               hint="every rank must pass a target of the same structure")
    entries = {p: catalog[p] for p in wanted}
    values: Dict[str, Any] = {}
    if entries:
        with Reader(entries, engine) as reader:
            for batch in read_batches(entries):
                values.update(read_values(final, reader, batch))
    if target is not None:
        return rebuild_target(target, values)
    return saved_tree(structure, values, {p: e.kind for p, e in catalog.items()})
