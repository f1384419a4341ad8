"""Creating files safely: a random name, ``O_CREAT|O_EXCL|O_NOFOLLOW``, in the directory meant.

Every file the library writes is created here, so a file or symlink planted
under a name we would use (``.checkpoint.tmp-<pid>`` was guessable) fails the
creation instead of being followed: nothing outside our directory is ever
written. ``replace_atomically`` writes a temporary of a random name, fsyncs
it, and renames it over the target only while that name is still the file it
created::

    >>> import os, tempfile
    >>> from mpistrat.safe_files import replace_atomically
    >>> path = os.path.join(tempfile.mkdtemp(), "state")
    >>> replace_atomically(path, lambda handle: handle.write(b"ok"))
    >>> open(path, "rb").read()
    b'ok'
"""

import os
import secrets
import stat
from typing import Callable

__all__ = ["create_exclusive", "random_temp", "same_file", "replace_atomically",
           "read_regular", "UnreadableFile"]

_CREATE = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
           | getattr(os, "O_CLOEXEC", 0))


def create_exclusive(path: str) -> int:
    """Create ``path`` and return its descriptor (read-write); a name that exists, a planted
    symlink included, raises ``FileExistsError`` and is left untouched."""
    return os.open(path, _CREATE, 0o666)


def random_temp(path: str) -> str:
    """A fresh, unguessable temporary name beside ``path``: ``DIR/.NAME.tmp-RANDOM``."""
    directory, base = os.path.split(path)
    return os.path.join(directory, f".{base}.tmp-{secrets.token_hex(16)}")


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` (not followed) is still the file open as ``fd``."""
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def replace_atomically(path: str, write: Callable, temp: str = "") -> None:
    """Write ``path`` atomically: ``write(handle)`` fills a temporary (binary) file created
    with ``create_exclusive``; fsync; rename over ``path`` while it is still ours. Nothing is
    left behind on failure, and nothing someone else put under a name is deleted."""
    temp = temp or random_temp(path)
    fd = create_exclusive(temp)
    ours = True
    try:
        with open(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            ours = same_file(handle.fileno(), temp)
            if not ours:
                raise FileExistsError(f"{temp} was replaced while it was written")
            os.replace(temp, path)
    except BaseException:
        if ours:
            try:
                os.remove(temp)
            except OSError:
                pass
        raise


class UnreadableFile(ValueError):
    """A file we read that is not a regular file, or larger than its kind may be."""


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes. Opened without
    blocking (a FIFO planted under the name never holds a rank) and checked on the open
    file (``fstat``); ``UnreadableFile`` when it is not a regular file or is larger,
    ``OSError`` (``FileNotFoundError``...) when it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile("is not a regular file")
        if info.st_size > limit:
            raise UnreadableFile(f"holds {info.st_size} bytes, more than the {limit} allowed")
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.pread(fd, left, info.st_size - left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
