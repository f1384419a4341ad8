"""TFRecord framing, as ``tensorflow/core/lib/io/record_writer.cc`` writes it.

Each record is::

    uint64 length | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data

(little-endian), one after another; a ``GZIP`` or ``ZLIB`` file is that stream compressed
as a whole. ``scan_offsets`` walks a plain file's headers (length CRCs checked, every record
inside the file) and returns the offset of every record plus the end, so any range of
records can be read with one read; ``split_records`` takes such a read apart, checking both
CRCs; ``stream_records`` reads a compressed (or plain) file from the start. Every error is a
``DataLossError`` naming the file and the record's offset::

    >>> from mpistrat.tfformats.records import frame, split_records
    >>> data = frame(b"one") + frame(b"")
    >>> split_records(data, 0, 2, "a test")
    [b'one', b'']
"""

import os
import struct
import zlib
from typing import Iterator, List, Optional, Tuple

import numpy as np

from mpistrat.errors import DataLossError, InvalidArgumentError, NotFoundError
from mpistrat.tfformats.crc import masked_crc32c

__all__ = ["frame", "scan_offsets", "split_records", "stream_records", "compression_of",
           "HEADER", "FOOTER"]

HEADER, FOOTER = 12, 4
_LENGTH = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_WBITS = {"GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}


def compression_of(compression_type: Optional[str]) -> Optional[str]:
    """``None``, ``"GZIP"`` or ``"ZLIB"`` from TensorFlow's spellings (``""`` is none)."""
    if compression_type in (None, ""):
        return None
    name = str(compression_type).upper()
    if name not in _WBITS:
        raise InvalidArgumentError(f"compression_type {compression_type!r}: use None, '', "
                                   f"'GZIP' or 'ZLIB'")
    return name


def frame(data: bytes) -> bytes:
    """One record framed for a TFRecord file."""
    length = struct.pack("<Q", len(data))
    return length + _CRC.pack(masked_crc32c(length)) + bytes(data) + \
        _CRC.pack(masked_crc32c(data))


def _header(where: str, view, pos: int, offset: int) -> int:
    """The data length of the record whose header starts at ``view[pos:]``."""
    length, stored = _LENGTH.unpack_from(view, pos)
    if masked_crc32c(bytes(view[pos:pos + 8])) != stored:
        raise DataLossError(f"{where}: corrupt record at offset {offset}: the CRC-32C of its "
                            f"length does not match")
    return length


def scan_offsets(path: str, window: int = 1 << 20) -> np.ndarray:
    """The byte offset of every record of the plain TFRecord file ``path``, then its size.

    Reads the file in windows of ``window`` bytes, seeking over records larger than that.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise NotFoundError(f"TFRecord file {path} does not exist") from None
    try:
        size = os.fstat(fd).st_size
        offsets: List[int] = []
        base, buffer = 0, b""
        offset = 0
        while offset < size:
            if offset + HEADER > size:
                raise DataLossError(f"{path}: truncated record at offset {offset}: "
                                    f"{size - offset} bytes left, a header needs {HEADER}")
            if offset + HEADER > base + len(buffer):  # the next header is outside the window
                base, buffer = offset, os.pread(fd, max(window, HEADER), offset)
                if len(buffer) < HEADER:
                    raise DataLossError(f"{path}: short read at offset {offset}")
            length = _header(path, buffer, offset - base, offset)
            end = offset + HEADER + length + FOOTER
            if end > size:
                raise DataLossError(f"{path}: truncated record at offset {offset}: it claims "
                                    f"{length} bytes of data, the file ends {size - offset - HEADER}"
                                    f" bytes after its header")
            offsets.append(offset)
            offset = end
        offsets.append(size)
        return np.array(offsets, dtype=np.int64)
    finally:
        os.close(fd)


def split_records(block, offset: int, count: int, where: str) -> List[bytes]:
    """The ``count`` records framed in ``block`` (read from ``offset`` of file ``where``)."""
    view = memoryview(block)
    records: List[bytes] = []
    pos, end = 0, len(view)
    crc = masked_crc32c
    for _ in range(count):
        if pos + HEADER > end:
            raise DataLossError(f"{where}: truncated record at offset {offset + pos}")
        length, stored = _LENGTH.unpack_from(view, pos)
        if crc(bytes(view[pos:pos + 8])) != stored:
            raise DataLossError(f"{where}: corrupt record at offset {offset + pos}: the "
                                f"CRC-32C of its length does not match")
        start = pos + HEADER
        if start + length + FOOTER > end:
            raise DataLossError(f"{where}: truncated record at offset {offset + pos}: it "
                                f"claims {length} bytes, {end - start} are left")
        data = bytes(view[start:start + length])
        if crc(data) != _CRC.unpack_from(view, start + length)[0]:
            raise DataLossError(f"{where}: corrupt record at offset {offset + pos}: the "
                                f"CRC-32C of its data does not match")
        records.append(data)
        pos = start + length + FOOTER
    if pos != end:
        raise DataLossError(f"{where}: records from offset {offset} do not end where the "
                            f"index says (the file changed after it was indexed?)")
    return records


class _Stream:
    """The decompressed bytes of a file, produced as they are asked for."""

    def __init__(self, handle, compression: Optional[str], buffer_size: int):
        self.handle, self.compression, self.chunk = handle, compression, buffer_size
        self.inflate = zlib.decompressobj(_WBITS[compression]) if compression else None
        self.pending = bytearray()
        self.done = False

    def take(self, n: int, where: str, offset: int, may_end: bool = False) -> Optional[bytes]:
        """The next ``n`` bytes; ``None`` at the end of the stream if ``may_end``."""
        while len(self.pending) < n and not self.done:
            self._fill(where)
        if len(self.pending) < n:
            if may_end and not self.pending:
                return None
            raise DataLossError(f"{where}: truncated record at offset {offset}: "
                                f"{len(self.pending)} bytes left, {n} needed")
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    def _fill(self, where: str) -> None:
        raw = self.handle.read(self.chunk)
        if self.inflate is None:
            self.pending += raw
            self.done = not raw
            return
        try:
            if raw:
                self.pending += self.inflate.decompress(raw)
                while self.inflate.eof and self.inflate.unused_data:  # concatenated members
                    rest = self.inflate.unused_data
                    self.inflate = zlib.decompressobj(_WBITS[self.compression])
                    self.pending += self.inflate.decompress(rest)
            else:
                if not self.inflate.eof:
                    raise DataLossError(f"{where}: the {self.compression} stream is truncated")
                self.done = True
        except zlib.error as err:
            raise DataLossError(f"{where}: the {self.compression} stream is corrupt "
                                f"({err})") from None


def stream_records(path: str, compression: Optional[str] = None,
                   buffer_size: int = 256 << 10) -> Iterator[Tuple[int, bytes]]:
    """``(offset, record)`` for every record of ``path`` from the start (offsets count
    decompressed bytes), both CRCs checked."""
    where = path if compression is None else f"{path} ({compression})"
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"TFRecord file {path} does not exist") from None
    with handle:
        stream = _Stream(handle, compression, max(int(buffer_size), 4096))
        offset = 0
        while True:
            header = stream.take(HEADER, where, offset, may_end=True)
            if header is None:
                return
            length = _header(where, header, 0, offset)
            body = stream.take(length + FOOTER, where, offset)
            if masked_crc32c(body[:length]) != _CRC.unpack_from(body, length)[0]:
                raise DataLossError(f"{where}: corrupt record at offset {offset}: the CRC-32C "
                                    f"of its data does not match")
            yield offset, body[:length]
            offset += HEADER + length + FOOTER
