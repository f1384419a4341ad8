"""Our cache of a TFRecord file's record offsets (not a TensorFlow format).

Finding record k of a TFRecord file means walking every header before it, so the offsets
(``records.scan_offsets``) are kept in a small file, made once per data file and rebuilt
when the data file changes (another size or modification time). The cache is treated as
hostile like any file: one that is damaged, for another file, or inconsistent with it is
ignored and rebuilt, never trusted. Layout (little-endian)::

    b"mpistrat tfrecord index\\n" | uint64 version, data file size, mtime (ns),
    compression (0 none, 1 GZIP, 2 ZLIB), record count, 0 | int64 offset x (count + 1)
    | uint32 CRC-32C of everything before

The cache lives in the user's cache directory (``$XDG_CACHE_HOME/mpistrat/tfrecord-index``,
by default ``~/.cache/...``), or in the directory named by ``index_dir``, as
``HASH-NAME.mpistrat-index`` (the hash of the data file's absolute path): never beside the
data, which may be read-only, shared with other users, or under version control::

    >>> import numpy as np, os, tempfile
    >>> from mpistrat.tfformats.records import frame
    >>> from mpistrat.tfformats.record_index import load_index, save_index
    >>> path = os.path.join(tempfile.mkdtemp(), "a.tfrecord")
    >>> with open(path, "wb") as f: _ = f.write(frame(b"x") + frame(b"yz"))
    >>> save_index(path, None, None, np.array([0, 17, 35]))
    True
    >>> load_index(path, None, None).tolist()
    [0, 17, 35]
"""

import hashlib
import os
import secrets
import struct
import tempfile
from typing import Optional

import numpy as np

from mpistrat.safe_files import replace_atomically
from mpistrat.tfformats.crc import crc32c, masked_crc32c

__all__ = ["default_index_dir", "index_path", "load_index", "save_index", "fingerprint"]

_MAGIC = b"mpistrat tfrecord index\n"
_VERSION = 1
_FIELDS = struct.Struct("<6Q")
_CODES = {None: 0, "GZIP": 1, "ZLIB": 2}
_MIN_RECORD = 16       # header and footer of an empty record


def default_index_dir() -> str:
    """``$XDG_CACHE_HOME/mpistrat/tfrecord-index`` (``~/.cache`` when it is not set)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        base = os.path.join(home, ".cache") if home != "~" else os.path.join(
            tempfile.gettempdir(), f"mpistrat-{os.getuid()}")   # (no home at all)
    return os.path.join(base, "mpistrat", "tfrecord-index")


def index_path(path: str, index_dir: Optional[str]) -> str:
    """Where the cache of data file ``path`` lives (``index_dir``, else the default)."""
    name = os.path.basename(path)
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    return os.path.join(index_dir or default_index_dir(), f"{digest}-{name}.mpistrat-index")


def fingerprint(path: str):
    """``(size, mtime in ns)`` of the data file: a cache made for other values is stale."""
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def load_index(path: str, compression: Optional[str], index_dir: Optional[str],
               stats: Optional[dict] = None) -> Optional[np.ndarray]:
    """The cached offsets of ``path``, or ``None`` if there is no usable cache.

    ``stats["index_bytes"]`` (when given) grows by the bytes read.
    """
    cache = index_path(path, index_dir)
    size, mtime = fingerprint(path)
    try:
        with open(cache, "rb") as handle:
            head = handle.read(len(_MAGIC) + _FIELDS.size)
            if len(head) < len(_MAGIC) + _FIELDS.size or not head.startswith(_MAGIC):
                return None
            version, got_size, got_mtime, code, count, _ = _FIELDS.unpack_from(head, len(_MAGIC))
            if (version, got_size, got_mtime, code) != (_VERSION, size, mtime,
                                                        _CODES[compression]):
                return None
            if os.fstat(handle.fileno()).st_size != len(head) + 8 * (count + 1) + 4:
                return None                             # checked before reading the offsets
            body = handle.read(8 * (count + 1) + 4)
    except (OSError, ValueError):
        return None
    if stats is not None:
        stats["index_bytes"] = stats.get("index_bytes", 0) + len(head) + len(body)
    if len(body) != 8 * (count + 1) + 4 or \
            crc32c(head + body[:-4]) != struct.unpack_from("<I", body, len(body) - 4)[0]:
        return None
    offsets = np.frombuffer(body[:-4], dtype="<i8").astype(np.int64)
    steps = np.diff(offsets)
    if offsets[0] != 0 or (steps.size and steps.min() < _MIN_RECORD) or \
            (compression is None and offsets[-1] != size):
        return None
    if compression is None and not _headers_agree(path, offsets):
        return None    # (a cache of another file with this size and time: rebuilt)
    return offsets


def _headers_agree(path: str, offsets: np.ndarray, samples: int = 64) -> bool:
    """Whether the record headers at a spread of cached offsets (the first, the last and up
    to ``samples`` between) are intact and give the lengths the offsets imply."""
    count = len(offsets) - 1
    picks = np.unique(np.linspace(0, count - 1, min(count, samples + 2)).astype(np.int64))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        for k in picks:
            head = os.pread(fd, 12, int(offsets[k]))
            if len(head) < 12:
                return False
            length, stored = struct.unpack("<QI", head)
            if masked_crc32c(head[:8]) != stored or length + 16 != offsets[k + 1] - offsets[k]:
                return False
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def save_index(path: str, compression: Optional[str], index_dir: Optional[str],
               offsets: np.ndarray) -> bool:
    """Write the cache of ``path`` (atomically); ``False`` if it cannot be written."""
    cache = index_path(path, index_dir)
    size, mtime = fingerprint(path)
    head = _MAGIC + _FIELDS.pack(_VERSION, size, mtime, _CODES[compression], len(offsets) - 1,
                                 0)  # the last field is reserved
    body = np.asarray(offsets, dtype="<i8").tobytes()
    data = head + body + struct.pack("<I", crc32c(head + body))
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        replace_atomically(cache, lambda handle: handle.write(data),
                           f"{cache}.tmp-{secrets.token_hex(16)}")  # O_EXCL|O_NOFOLLOW
        return True
    except OSError:
        return False
