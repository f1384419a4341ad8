"""One open descriptor per checkpoint file: its catalog and its data come from the same file.

A restore opens each file once. h5py reads the catalog through that
descriptor (a file object over ``os.pread``), and the data is read with
``os.preadv`` on it too, so a checkpoint committed under the same name
meanwhile (a rename over it) cannot mix one file's catalog with another's
bytes. The descriptor stays open as long as a value read from it may still be
needed (values pending for objects attached later), so a checkpoint deleted by
rotation stays readable until then; it is closed when the last entry that
refers to it is gone::

    >>> import os, tempfile
    >>> from mpistrat.checkpoint.openfile import OpenFile
    >>> path = tempfile.mktemp(); open(path, "wb").write(b"abc") and None
    >>> handle = OpenFile(path); os.remove(path)
    >>> handle.size, handle.pread(2, 1)
    (3, b'bc')
"""

import io
import os
import weakref

__all__ = ["OpenFile"]


class _Reader(io.RawIOBase):
    """A read-only, seekable file object over a descriptor, for h5py (never closes it)."""

    def __init__(self, fd: int, size: int):
        super().__init__()
        self._fd, self._size, self._pos = fd, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        got = os.preadv(self._fd, [buffer], self._pos)
        self._pos += got
        return got

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class OpenFile:
    """A checkpoint file opened once for reading; ``h5()`` opens h5py on the same descriptor."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._closer = weakref.finalize(self, os.close, self.fd)
        self.size = os.fstat(self.fd).st_size

    def h5(self):
        """An ``h5py.File`` reading through this descriptor (close it when done)."""
        import h5py
        return h5py.File(_Reader(self.fd, self.size), "r")

    def pread(self, nbytes: int, offset: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def close(self) -> None:
        self._closer()
