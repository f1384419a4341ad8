"""Names of checkpoint files, the marker that proves a file is ours, and clean-up.

A checkpoint ``dir/ckpt-3`` is the file ``dir/ckpt-3.h5`` (plus, in part-file
mode, ``dir/ckpt-3.part-R-of-N-TOKEN.h5``). While it is written it is
``dir/.ckpt-3.h5.tmp-TOKEN``. Each is created with ``O_CREAT|O_EXCL|O_NOFOLLOW``
(``create_exclusive``) under a random name, and renamed into place only while it is
still the file we created (``same_file``), so a planted file or symlink never makes
us write anywhere else. Every file this library writes starts with a
512-byte HDF5 user block holding :data:`MARKER`; clean-up deletes only files
whose name follows one of our patterns *and* that start with the marker, so
other programs' files in the same directory are never touched.

    >>> from mpistrat.checkpoint.files import data_file, state_name
    >>> data_file("/tmp/run/ckpt-3")
    '/tmp/run/ckpt-3.h5'
    >>> state_name("/tmp/run", "ckpt-3"), state_name("/tmp/run", "../victim/data")
    ('ckpt-3', None)
"""

import glob
import os
import re
import secrets
import warnings
from typing import Iterable, List, Optional

from mpistrat.safe_files import create_exclusive, same_file  # noqa: F401 - re-exported

__all__ = ["data_file", "temp_name", "part_name", "MARKER", "USERBLOCK",
           "create_exclusive", "random_temp", "same_file",
           "is_ours", "state_name", "check_checkpoint_name", "local_view", "remove_checkpoint", "remove_leftovers",
           "missing_hint"]

USERBLOCK = 512                              # bytes reserved at the start of each HDF5 file
MARKER = b"mpistrat checkpoint file\n"       # the first bytes of every file we write
TOKEN_HEX = 32                               # hex digits of the per-save random token

# A checkpoint name is one file name: any text without '/', NUL or control characters
# (the state file is one name a line), not '.' or '..'.
_NAME_TEXT = r"[^/\x00-\x1f\x7f]+"
_TEMP = re.compile(r"^\.(?P<final>%s)\.tmp-[0-9a-f]{%d}$" % (_NAME_TEXT, TOKEN_HEX))
_PART = re.compile(r"^(?P<stem>%s)\.part-(?P<rank>\d+)-of-(?P<size>\d+)"
                   r"(?:-(?P<token>[0-9a-f]{%d}))?\.h5$" % (_NAME_TEXT, TOKEN_HEX))
_NAME = re.compile(r"^%s$" % _NAME_TEXT)


def data_file(prefix: str) -> str:
    """The HDF5 file of checkpoint ``prefix``."""
    return prefix if prefix.endswith(".h5") else prefix + ".h5"


def temp_name(final: str, token: str) -> str:
    """The name ``final`` is written under until it is complete."""
    directory, base = os.path.split(final)
    return os.path.join(directory, f".{base}.tmp-{token}")


def part_name(final: str, rank: int, size: int, token: str) -> str:
    """Rank ``rank``'s part file of ``final`` in part-file mode (the token keeps older parts)."""
    stem = final[:-3] if final.endswith(".h5") else final
    return f"{stem}.part-{rank}-of-{size}-{token}.h5"


def part_match(name: str, stem: str) -> Optional[re.Match]:
    """The match of a part-file base name belonging to checkpoint ``stem``, else ``None``."""
    match = _PART.match(name)
    return match if match and match["stem"] == stem else None


def random_temp(directory: str, base: str) -> str:
    """A fresh temporary name ``directory/.BASE.tmp-RANDOM`` (never guessable)."""
    return temp_name(os.path.join(directory, base), secrets.token_hex(TOKEN_HEX // 2))


def is_ours(path: str) -> bool:
    """Whether ``path`` is a regular file that starts with our marker (format 2 and later)."""
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return False
        with open(path, "rb") as handle:
            return handle.read(len(MARKER)) == MARKER
    except OSError:
        return False


def state_name(directory: str, name: str) -> Optional[str]:
    """A checkpoint name from the state file, as a base name inside ``directory``, or ``None``.

    TensorFlow writes names relative to the directory. An absolute name is
    accepted only when it lies directly in ``directory``; anything else
    (``..``, sub-directories, other directories) is refused, so a state file
    can neither make us read outside the directory nor delete anything there.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        return None
    if os.path.isabs(name):
        parent, base = os.path.split(os.path.normpath(name))
        if os.path.realpath(parent) != os.path.realpath(directory or "."):
            return None
        name = base
    if not _NAME.match(name) or name in (".", ".."):
        return None
    return name


def check_checkpoint_name(name) -> str:
    """A ``checkpoint_name`` whose checkpoints the state file can name again, else ``ValueError``.

    One file name (``"ckpt"``, ``"model ckpt"``, ``"模型"``): no '/', NUL or control
    characters, not starting with '.' (our temporary files do).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint_name must be a non-empty string, got {name!r}")
    if "/" in name or os.sep in name:
        raise ValueError(f"checkpoint_name {name!r} contains '/': the state file names "
                         f"checkpoints inside the manager's directory only; put the "
                         f"sub-directory in `directory` instead")
    if name.startswith(".") or not _NAME.match(name) or state_name(".", name + "-1") is None:
        raise ValueError(f"checkpoint_name {name!r} is not allowed: use one file name without "
                         f"control characters, not starting with '.'")
    return name


def local_view(path: str) -> str:
    """What this rank sees at ``path``: ``file``, ``dir``, ``missing`` or ``other``."""
    if os.path.isfile(path):
        return "file"
    if os.path.isdir(path):
        return "dir"
    return "missing" if not os.path.lexists(path) else "other"


def missing_hint(path: str) -> str:
    """A hint for a missing checkpoint path (the ``-N`` suffix of ``save``)."""
    if re.search(r"-\d+(\.h5)?$", path):
        return ""
    siblings = sorted(glob.glob(glob.escape(path) + "-*.h5"))
    return ("; checkpoints written by save() carry a '-N' suffix"
            + (f", e.g. {siblings[-1][:-3]}" if siblings else ""))


def _remove(path: str, removed: List[str]) -> None:
    """Delete one file of ours; clean-up never fails a save (it warns and goes on)."""
    try:
        os.remove(path)
        removed.append(os.path.basename(path))
    except FileNotFoundError:
        pass
    except OSError as err:
        warnings.warn(f"mpistrat could not delete its file {path}: {err}", RuntimeWarning,
                      stacklevel=3)


def _parts_of(final: str) -> Iterable[str]:
    directory, base = os.path.split(final)
    stem = base[:-3]
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names if part_match(n, stem)]


def remove_checkpoint(prefix: str, keep_token: Optional[str] = None) -> List[str]:
    """Delete checkpoint ``prefix`` (its file and part files), if they are ours.

    With ``keep_token``, only the part files of other saves are deleted (the
    clean-up after a save that replaced the same prefix). Returns the names removed.
    """
    final, removed = data_file(prefix), []
    if keep_token is None and is_ours(final):
        _remove(final, removed)
    for path in _parts_of(final):
        match = _PART.match(os.path.basename(path))
        if keep_token is not None and match["token"] == keep_token:
            continue
        if is_ours(path):
            _remove(path, removed)
    return removed


def remove_leftovers(directory: str) -> List[str]:
    """Delete what torn saves left in ``directory``: our temporary files and orphaned parts.

    A file is deleted only when its name follows our pattern and it starts
    with our marker; returns the names removed.
    """
    removed: List[str] = []
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        temp, part = _TEMP.match(name), _PART.match(name)
        if temp and is_ours(path):
            _remove(path, removed)
        elif part and part["token"] and is_ours(path) \
                and _orphan(os.path.join(directory, part["stem"] + ".h5"), part["token"]):
            _remove(path, removed)
    return removed


def _orphan(master: str, token: str) -> bool:
    """Whether no complete master refers to the parts of save ``token``."""
    if not is_ours(master):
        return True
    import h5py  # the master names the token of the parts it maps
    try:
        with h5py.File(master, "r") as f:
            return f.attrs.get("mpistrat_token") != token
    except (OSError, ValueError):
        return False  # unreadable: leave it alone
