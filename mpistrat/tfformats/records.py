"""TFRecord framing, as ``tensorflow/core/lib/io/record_writer.cc`` writes it.

Each record is::

    uint64 length | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data

(little-endian), one after another; a ``GZIP`` or ``ZLIB`` file is that stream compressed
as a whole. ``scan_offsets`` walks a plain file's headers (length CRCs checked, every record
inside the file) and returns the offset of every record plus the end, so any range of
records can be read with one read; ``split_records`` takes such a read apart (``parse_frames`` any
run of records), checking both CRCs; ``stream_chunks``/``stream_records`` read a compressed (or plain) file from the start. Every error is a
``DataLossError`` naming the file and the record's offset::

    >>> from mpistrat.tfformats.records import frame, parse_frames
    >>> data = frame(b"one") + frame(b"")
    >>> parse_frames(data, 0, "a test")
    ([b'one', b''], 35)
"""

import functools
import os
import struct
import zlib
from typing import Iterator, List, Optional, Tuple

import numpy as np

from mpistrat.errors import DataLossError, InvalidArgumentError, NotFoundError
from mpistrat.tfformats.crc import crc_function, crc_table, masked_crc32c

__all__ = ["frame", "scan_offsets", "parse_frames", "split_records", "stream_chunks",
           "stream_records", "compression_of", "HEADER", "FOOTER"]

HEADER, FOOTER = 12, 4
_MASK_DELTA = 0xA282EAD8
_LENGTH = struct.Struct("<QI")
_U64 = struct.Struct("<Q")
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


def _masked(crc: np.ndarray) -> np.ndarray:
    """``crc.mask`` of many CRCs at once (uint32 arithmetic wraps as the mask needs)."""
    return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)


@functools.lru_cache(maxsize=None)
def _table() -> np.ndarray:
    return np.asarray(crc_table(), dtype=np.uint32)


def _crc_of_lengths(heads: np.ndarray) -> np.ndarray:
    """The CRC-32C of each row of 8 bytes (every record's length field), table-driven."""
    table = _table()
    crc = np.full(len(heads), 0xFFFFFFFF, dtype=np.uint32)
    for column in range(8):
        crc = table[(crc ^ heads[:, column]) & np.uint32(0xFF)] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


def _first_bad(computed: np.ndarray, stored: np.ndarray) -> Optional[int]:
    bad = np.flatnonzero(_masked(computed) != stored)
    return int(bad[0]) if bad.size else None


def parse_frames(data: bytes, offset: int, where: str) -> Tuple[List[bytes], int]:
    """The complete records at the start of ``data``, both CRCs checked, and the number of
    bytes they took; ``data`` came from ``offset`` of file ``where``.

    An incomplete record at the end is left for the caller (more bytes may follow), once
    its length's CRC is checked.
    """
    unpack, pos, end = _U64.unpack_from, 0, len(data)
    starts: List[int] = []
    while pos + HEADER <= end:                  # walk the lengths; check them all after
        stop = pos + HEADER + unpack(data, pos)[0] + FOOTER
        if stop > end:
            _header(where, data, pos, offset + pos)   # a corrupt length is named as such
            break
        starts.append(pos)
        pos = stop
    return _checked(data, offset, where, np.array(starts, dtype=np.int64)), pos


def _checked(data: bytes, offset: int, where: str, starts: np.ndarray) -> List[bytes]:
    """The records framed at ``starts`` in ``data``, every CRC checked at once (NumPy for
    the lengths, one call per record for the data); the first record that fails is named."""
    if not starts.size:
        return []
    view = np.frombuffer(data, dtype=np.uint8)
    heads = view[starts[:, None] + np.arange(HEADER)]
    lengths = heads[:, :8].copy().view("<u8")[:, 0].astype(np.int64)
    bad = _first_bad(_crc_of_lengths(heads), heads[:, 8:].copy().view("<u4")[:, 0])
    if bad is not None:
        raise DataLossError(f"{where}: corrupt record at offset {offset + int(starts[bad])}: "
                            f"the CRC-32C of its length does not match")
    stops = starts + HEADER + lengths
    if int(stops[-1]) + FOOTER > len(data) or (starts.size > 1 and np.any(
            stops[:-1] + FOOTER != starts[1:])):
        raise DataLossError(f"{where}: records from offset {offset} do not lie where the "
                            f"index says (the file changed after it was indexed?)")
    records = [data[a:b] for a, b in zip((starts + HEADER).tolist(), stops.tolist())]
    tails = view[stops[:, None] + np.arange(FOOTER)]
    value = crc_function()
    bad = _first_bad(np.fromiter(map(value, records), dtype=np.uint32, count=len(records)),
                     tails.copy().view("<u4")[:, 0])
    if bad is not None:
        raise DataLossError(f"{where}: corrupt record at offset {offset + int(starts[bad])}: "
                            f"the CRC-32C of its data does not match")
    return records


def split_records(block, offset: int, starts: np.ndarray, where: str) -> List[bytes]:
    """The records framed in ``block``, read from ``offset`` of file ``where``, which the
    index says start at file offsets ``starts`` and fill the block exactly."""
    data = block if isinstance(block, bytes) else bytes(block)
    starts = np.asarray(starts, dtype=np.int64) - offset
    records = _checked(data, offset, where, starts)
    if records and int(starts[-1]) + HEADER + len(records[-1]) + FOOTER != len(data):
        raise DataLossError(f"{where}: records from offset {offset} do not end where the "
                            f"index says (the file changed after it was indexed?)")
    return records


def _chunks(handle, compression: Optional[str], size: int, where: str) -> Iterator[bytes]:
    """The file's bytes (decompressed) in pieces of about ``size``."""
    inflate = zlib.decompressobj(_WBITS[compression]) if compression else None
    while True:
        raw = handle.read(size)
        if inflate is None:
            if not raw:
                return
            yield raw
            continue
        try:
            if not raw:
                if not inflate.eof:
                    raise DataLossError(f"{where}: the {compression} stream is truncated")
                return
            out = inflate.decompress(raw)
            while inflate.eof and inflate.unused_data:   # concatenated members
                rest = inflate.unused_data
                inflate = zlib.decompressobj(_WBITS[compression])
                out += inflate.decompress(rest)
        except zlib.error as err:
            raise DataLossError(f"{where}: the {compression} stream is corrupt "
                                f"({err})") from None
        if out:
            yield out


def stream_chunks(path: str, compression: Optional[str] = None,
                  buffer_size: int = 1 << 20, stats: Optional[dict] = None
                  ) -> Iterator[List[bytes]]:
    """Every record of ``path`` from the start, in lists (one per piece read), both CRCs
    checked; ``stats["bytes"]`` (when given) counts the bytes read from the file."""
    where = path if compression is None else f"{path} ({compression})"
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"TFRecord file {path} does not exist") from None
    with handle:
        pending, offset = b"", 0
        for chunk in _chunks(handle, compression, max(int(buffer_size), 4096), where):
            if stats is not None:
                stats["bytes"] = handle.tell()
            pending = pending + chunk if pending else chunk
            records, used = parse_frames(pending, offset, where)
            if records:
                yield records
            pending, offset = pending[used:], offset + used
        if pending:
            if len(pending) < HEADER:
                raise DataLossError(f"{where}: truncated record at offset {offset}: "
                                    f"{len(pending)} bytes left, a header needs {HEADER}")
            length = _LENGTH.unpack_from(pending, 0)[0]
            raise DataLossError(f"{where}: truncated record at offset {offset}: it claims "
                                f"{length} bytes of data, {len(pending) - HEADER} are left")


def stream_records(path: str, compression: Optional[str] = None,
                   buffer_size: int = 1 << 20) -> Iterator[Tuple[int, bytes]]:
    """``(offset, record)`` for every record of ``path`` from the start (offsets count
    decompressed bytes), both CRCs checked."""
    offset = 0
    for records in stream_chunks(path, compression, buffer_size):
        for record in records:
            yield offset, record
            offset += HEADER + len(record) + FOOTER
