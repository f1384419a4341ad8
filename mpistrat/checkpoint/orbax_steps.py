"""Step directories of the Orbax face: ``DIR/<step>/``, one HDF5 file per item and a manifest.

A step is written as ``DIR/.<step>.tmp-TOKEN/`` (``<item>.h5`` for each item, written by
``h5write``, then ``_mpistrat_step.json``: the format, the step, the items and each item's
tree structure), and renamed to ``DIR/<step>`` once complete: a numbered directory holding
the manifest is a complete checkpoint, anything else is not one. Step names are canonical
decimals (``7``, never ``07``). Functions here run on one rank; the manager agrees on their
results. The manifest is JSON, read with a size cap and checked field by field.

    >>> import os, tempfile
    >>> from mpistrat.checkpoint.orbax_steps import scan, step_dir
    >>> root = tempfile.mkdtemp(); os.mkdir(step_dir(root, 3))   # no manifest: not a step
    >>> scan(root)
    ([], ['3'])
"""

import hashlib
import json
import os
import re
import secrets
import warnings
from typing import Dict, List, Tuple

from mpistrat.checkpoint.files import is_ours
from mpistrat.checkpoint.graph import check_segment
from mpistrat.checkpoint.h5write import fsync_dir
from mpistrat.checkpoint.orbax_tree import saved_leaves
from mpistrat.errors import DataLossError
from mpistrat.safe_files import UnreadableFile, read_regular, replace_atomically

__all__ = ["MANIFEST", "step_dir", "temp_dir", "scan", "check_item_name", "write_manifest",
           "read_manifest", "commit", "delete_step", "remove_stale", "foreign_hint"]

MANIFEST = "_mpistrat_step.json"
FORMAT = "mpistrat.orbax-step"
VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
_STEP = re.compile(r"^(0|[1-9][0-9]*)$")
_TEMP = re.compile(r"^\.(0|[1-9][0-9]*)\.tmp-[0-9a-f]{32}$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, str(step))


def temp_dir(directory: str, step: int, token: str) -> str:
    """Where step ``step`` is written until it is complete."""
    return os.path.join(directory, f".{step}.tmp-{token}")


def scan(directory: str) -> Tuple[List[int], List[str]]:
    """``(complete steps ascending, numbered names that are not complete steps)``."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    steps, unknown = [], []
    for name in names:
        path = os.path.join(directory, name)
        if not name.isdigit() or not os.path.isdir(path):
            continue
        if _STEP.match(name) and not os.path.islink(path) and \
                os.path.isfile(os.path.join(path, MANIFEST)):
            steps.append(int(name))
        else:
            unknown.append(name)
    return sorted(steps), sorted(unknown)


def check_item_name(name) -> str:
    """An item name: one path segment of ASCII letters, digits, '_', '.' and '-', not starting
    with '.' or '_' (ours), else ``ValueError``. Items are files (``<item>.h5``), and file
    systems that normalise or fold case would make two other names one file: object names
    inside an item may be of any script, item names may not."""
    if not isinstance(name, str) or name[:1] in ("", ".", "_"):
        raise ValueError(f"item name {name!r} is not allowed: start with a letter or digit")
    if not name.isascii():
        raise ValueError(f"item name {name!r} is not allowed: an item is a file, so its name "
                         f"is ASCII letters, digits, '_', '.' and '-'")
    return check_segment(name)


def write_manifest(path: str, step: int, single: bool, structures: Dict[str, dict]) -> None:
    """Write the manifest of a step being saved into its temporary directory ``path``."""
    text = json.dumps({"format": FORMAT, "version": VERSION, "step": step,
                       "mode": "single" if single else "composite", "items": structures},
                      separators=(",", ":")).encode("utf-8")
    replace_atomically(os.path.join(path, MANIFEST), lambda handle: handle.write(text))


def read_manifest(path: str, step: int) -> Tuple[str, dict]:
    """``(digest, manifest)`` of step directory ``path``; ``DataLossError`` when it is not a
    manifest of ours for ``step`` (``FileNotFoundError`` when there is none)."""
    where = os.path.join(path, MANIFEST)
    try:
        raw = read_regular(where, MAX_MANIFEST_BYTES)
    except UnreadableFile as err:
        raise DataLossError(f"{where} {err}") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise DataLossError(f"{where} is not a readable manifest ({type(err).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataLossError(f"{where} is not an mpistrat step manifest")
    if manifest.get("version") != VERSION:
        raise DataLossError(f"{where}: format version {manifest.get('version')!r} (this version "
                            f"reads {VERSION})")
    if manifest.get("step") != step or isinstance(manifest.get("step"), bool):
        raise DataLossError(f"{where} names step {manifest.get('step')!r}, not {step}: a step "
                            f"directory was renamed or copied")
    items, mode = manifest.get("items"), manifest.get("mode")
    if not isinstance(items, dict) or mode not in ("single", "composite") or \
            (mode == "single" and list(items) != ["default"]):
        raise DataLossError(f"{where}: items {str(items)[:80]} do not fit mode {mode!r}")
    for name, structure in items.items():
        try:
            check_item_name(name)
        except ValueError as err:
            raise DataLossError(f"{where}: {err}") from None
        saved_leaves(structure, f"{where}, item {name!r}")
    return hashlib.sha1(raw).hexdigest(), manifest


def commit(temp: str, final: str, directory: str) -> None:
    """Rename the complete step ``temp`` to ``final`` (never over anything), durably."""
    fsync_dir(temp)
    if os.path.lexists(final):
        raise FileExistsError(f"{final} appeared while the step was written")
    os.rename(temp, final)
    fsync_dir(directory)


def _ours(path: str) -> Tuple[List[str], List[str]]:
    """``(our entries, other entries)`` of a step directory."""
    ours, others = [], []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        (ours if name == MANIFEST and not os.path.islink(full) or is_ours(full)
         else others).append(name)
    return ours, others


def _discard(path: str, names: List[str]) -> None:
    for name in ([MANIFEST] if MANIFEST in names else []) + \
            [n for n in names if n != MANIFEST]:       # the manifest first: no longer a step
        os.remove(os.path.join(path, name))


def delete_step(directory: str, step: int) -> None:
    """Delete step ``step``: renamed aside first (it stops being a step at once), then our
    files. A directory that also holds files not ours loses only its manifest and our files."""
    path = step_dir(directory, step)
    ours, others = _ours(path)
    if others:
        _discard(path, ours)
        warnings.warn(f"deleted checkpoint step {path} but left the directory: it holds files "
                      f"mpistrat did not write: {others[:5]}", RuntimeWarning, stacklevel=3)
        return
    aside = temp_dir(directory, step, secrets.token_hex(16))
    os.rename(path, aside)
    _discard(aside, ours)
    os.rmdir(aside)


def remove_stale(directory: str) -> List[str]:
    """Remove temporary step directories that torn saves or deletions left, when they hold
    only our files (best effort: warns about what it cannot delete). Returns their names."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        if not _TEMP.match(name) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            ours, others = _ours(path)
            if others:
                continue
            _discard(path, ours)
            os.rmdir(path)
            removed.append(name)
        except OSError as err:
            warnings.warn(f"mpistrat could not remove its temporary step directory {path}: "
                          f"{err}", RuntimeWarning, stacklevel=2)
    return removed


def foreign_hint(path: str) -> str:
    """A hint for a numbered directory that is not ours (Orbax's own layout, say)."""
    if os.path.isdir(os.path.join(path, "default")) or \
            os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        return ("; it looks like a checkpoint written by Orbax itself, whose format mpistrat "
                "does not read: restore it with Orbax and save it again through mpistrat")
    return "; a torn or foreign directory, or one written by another program"
