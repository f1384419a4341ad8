"""LevelDB's sorted table (SSTable) format, as TensorFlow writes its checkpoint ``.index``.

A table is data blocks, a metaindex block, an index block and a 48-byte footer::

    footer:  metaindex handle, index handle (varint64 offset + size each), zero padding to
             40 bytes, magic 0xdb4775248b80fb57 (fixed64, little-endian)
    block:   entries, restart offsets (fixed32 each), their count (fixed32),
             then a trailer: type byte (0 raw, 1 snappy) + masked CRC-32C of contents + type
    entry:   varint32 shared key bytes, varint32 unshared, varint32 value length,
             the unshared key bytes, the value (keys are prefix-compressed between restarts)

The index block maps a key at or after each data block's last key to that block's handle.
``read_table`` checks everything (sizes, handles inside the file, CRCs, varints, restart
points, strictly increasing keys) before it returns a single entry, and its work is bounded
by the file's size: the data blocks must lie in order before the index block, each after the
previous one (a block listed twice, overlapping, pointing backwards or at the index block is
refused, so no byte is parsed twice), none is empty, and the keys that prefix compression
expands must stay within ``key_budget(len(file))`` bytes (a crafted block whose every key
repeats the one before plus a byte would otherwise expand quadratically).
``build_table`` writes the same format::

    >>> from mpistrat.tfformats.sstable import build_table, read_table
    >>> data = build_table([(b"", b"header"), (b"a/b", b"1"), (b"a/c", b"2")])
    >>> read_table(data, "example.index")
    [(b'', b'header'), (b'a/b', b'1'), (b'a/c', b'2')]
"""

import struct
from typing import Iterable, List, Optional, Tuple

from mpistrat.errors import DataLossError
from mpistrat.tfformats.crc import masked_crc32c
from mpistrat.tfformats.wire import WireError, read_varint, varint

__all__ = ["read_table", "build_table", "key_budget", "MAGIC", "FOOTER_BYTES"]

MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
_TRAILER = 5
_RAW, _SNAPPY = 0, 1
_SNAPPY_MAX_RATIO = 32  # snappy's longest copy (64 bytes from 3) bounds the expansion


def key_budget(file_bytes: int) -> int:
    """The most key bytes a table of ``file_bytes`` may expand to: 64 MiB plus 16 per byte
    of the file (TensorFlow's indexes expand 2-5 times; a real one of 300-byte keys sharing
    all but 10 bytes, under 30 times, only in files far below the 64 MiB)::

        >>> key_budget(1000) - (64 << 20)
        16000
    """
    return (64 << 20) + 16 * file_bytes


def _fail(where: str, what: str, key: Optional[bytes] = None) -> DataLossError:
    near = "" if key is None else f" (after key {key.decode('utf-8', 'replace')!r})"
    return DataLossError(f"{where}: {what}{near}: the file is corrupt or not a TensorFlow "
                         f"checkpoint index")


def _handle(data, pos: int, end: int, where: str) -> Tuple[Tuple[int, int], int]:
    try:
        offset, pos = read_varint(data, pos, end)
        size, pos = read_varint(data, pos, end)
    except WireError as err:
        raise _fail(where, f"bad block handle ({err})") from None
    return (offset, size), pos


def _block(data, handle: Tuple[int, int], limit: int, where: str, what: str) -> bytes:
    """The checked contents of the block at ``handle`` (uncompressed)."""
    offset, size = handle
    if offset + size + _TRAILER > limit:
        raise _fail(where, f"the {what} block at offset {offset} of {size} bytes runs past "
                           f"byte {limit}, where the "
                           f"{'index block' if what == 'data' else 'footer'} starts (the "
                           f"file is truncated?)")
    contents = data[offset:offset + size]
    kind = data[offset + size]
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    if masked_crc32c(data[offset:offset + size + 1]) != stored:
        raise _fail(where, f"CRC-32C mismatch in the {what} block at offset {offset}")
    if kind == _RAW:
        return bytes(contents)
    if kind == _SNAPPY:
        return _unsnappy(bytes(contents), where, what, offset)
    raise _fail(where, f"the {what} block at offset {offset} has unknown type {kind}")


def _unsnappy(contents: bytes, where: str, what: str, offset: int) -> bytes:
    try:
        claimed, _ = read_varint(contents, 0, len(contents))
    except WireError:
        raise _fail(where, f"the snappy {what} block at offset {offset} has no length") from None
    if claimed > _SNAPPY_MAX_RATIO * len(contents) + 64:
        raise _fail(where, f"the snappy {what} block at offset {offset} claims {claimed} bytes "
                           f"from {len(contents)}")
    try:
        import cramjam
    except ImportError:
        raise DataLossError(f"{where}: the {what} block at offset {offset} is snappy-compressed; "
                            f"install cramjam to read it") from None
    try:
        raw = bytes(cramjam.snappy.decompress_raw(contents))
    except Exception as err:  # noqa: BLE001 - cramjam's DecompressionError
        raise _fail(where, f"the snappy {what} block at offset {offset} does not decompress "
                           f"({err})") from None
    if len(raw) != claimed:
        raise _fail(where, f"the snappy {what} block at offset {offset} decompressed to "
                           f"{len(raw)} bytes, not {claimed}")
    return raw


def _entries(block: bytes, where: str, what: str, last: Optional[bytes], budget: List[int]):
    """The ``(key, value)`` entries of one block, keys checked strictly increasing; each
    key's bytes are taken from ``budget[0]`` (``DataLossError`` once it is spent)."""
    if len(block) < 4:
        raise _fail(where, f"a {what} block of {len(block)} bytes has no restart count", last)
    (count,) = struct.unpack_from("<I", block, len(block) - 4)
    if count == 0 or count > (len(block) - 4) // 4:
        raise _fail(where, f"a {what} block claims {count} restart points in "
                           f"{len(block)} bytes", last)
    end = len(block) - 4 * (count + 1)
    restarts = struct.unpack_from(f"<{count}I", block, end)
    if restarts[0] != 0 or any(a >= b for a, b in zip(restarts, restarts[1:])):
        raise _fail(where, f"a {what} block's restart array is not increasing from 0 "
                           f"({list(restarts[:4])}...)", last)
    if restarts[-1] >= max(end, 1):
        raise _fail(where, f"a {what} block has a restart point beyond its entries", last)
    out: List[Tuple[bytes, bytes]] = []
    key = b""
    pos = 0
    at = 0             # the next restart point to meet
    while pos < end:
        start = pos
        try:
            shared, pos = read_varint(block, pos, end)
            unshared, pos = read_varint(block, pos, end)
            length, pos = read_varint(block, pos, end)
        except WireError as err:
            raise _fail(where, f"bad entry in a {what} block ({err})", last) from None
        restart = at < count and restarts[at] == start
        if at < count and restarts[at] < start:
            raise _fail(where, f"a {what} block has restart point {restarts[at]} inside an "
                               f"entry", last)
        at += restart
        if shared > len(key) or (restart and shared) or unshared + length > end - pos:
            raise _fail(where, f"bad entry in a {what} block at byte {start}", last)
        budget[0] -= shared + unshared
        if budget[0] < 0:
            raise _fail(where, f"its keys expand past {key_budget(0) >> 20} MiB plus 16 bytes "
                               f"per byte of the file (a crafted prefix compression)", last)
        key = key[:shared] + block[pos:pos + unshared]
        value = block[pos + unshared:pos + unshared + length]
        pos += unshared + length
        if last is not None and key <= last:
            raise _fail(where, f"keys out of order: {key.decode('utf-8', 'replace')!r} follows",
                        last)
        out.append((key, value))
        last = key
    if at < count and (out or restarts != (0,)):
        raise _fail(where, f"a {what} block has restart points between its entries", last)
    return out


def read_table(data, where: str) -> List[Tuple[bytes, bytes]]:
    """Every ``(key, value)`` of the table in ``data`` (a whole file), in key order.

    ``where`` names the file in errors (``DataLossError``, naming the last good key).
    """
    data = memoryview(data)
    if len(data) < FOOTER_BYTES:
        raise _fail(where, f"{len(data)} bytes is too short for a table footer "
                           f"({FOOTER_BYTES} bytes; the file is truncated?)")
    footer = len(data) - FOOTER_BYTES
    (magic,) = struct.unpack_from("<Q", data, len(data) - 8)
    if magic != MAGIC:
        raise _fail(where, f"bad magic number {magic:#018x} (expected {MAGIC:#018x})")
    _, pos = _handle(data, footer, footer + 40, where)        # metaindex: nothing we need
    index_handle, _ = _handle(data, pos, footer + 40, where)
    budget = [key_budget(len(data))]
    index = _entries(_block(data, index_handle, footer, where, "index"), where, "index", None,
                     budget)
    out: List[Tuple[bytes, bytes]] = []
    last: Optional[bytes] = None
    free = 0           # data blocks lie in order, each after the one before, all before the index
    for index_key, encoded in index:
        handle, used = _handle(encoded, 0, len(encoded), where)
        if used != len(encoded):
            raise _fail(where, "an index entry holds more than a block handle", last)
        if handle[0] < free:
            raise _fail(where, f"the index lists a data block at offset {handle[0]}, before the "
                               f"end of the block listed before it ({free}): a block listed "
                               f"twice, overlapping or out of order", last)
        block = _entries(_block(data, handle, index_handle[0], where, "data"), where, "data",
                         last, budget)
        if not block:
            raise _fail(where, f"the data block at offset {handle[0]} holds no entries", last)
        if block[-1][0] > index_key:
            raise _fail(where, "an index key sorts before its block's last key", block[-1][0])
        free = handle[0] + handle[1] + _TRAILER
        out.extend(block)
        last = out[-1][0]
    return out


def _block_bytes(entries: List[Tuple[bytes, bytes]], restart_interval: int) -> bytes:
    body, restarts, previous = bytearray(), [], b""
    for number, (key, value) in enumerate(entries):
        shared = 0
        if number % restart_interval:
            limit = min(len(previous), len(key))
            while shared < limit and previous[shared] == key[shared]:
                shared += 1
        else:
            restarts.append(len(body))
        body += varint(shared) + varint(len(key) - shared) + varint(len(value))
        body += key[shared:] + value
        previous = key
    restarts = restarts or [0]
    return bytes(body) + struct.pack(f"<{len(restarts)}I", *restarts) + \
        struct.pack("<I", len(restarts))


def build_table(entries: Iterable[Tuple[bytes, bytes]], compression: Optional[str] = None,
                block_size: int = 262144, restart_interval: int = 16) -> bytes:
    """A table holding ``entries`` (keys strictly increasing); ``compression="snappy"``
    compresses blocks that shrink by an eighth or more, as LevelDB does."""
    out = bytearray()

    def write_block(block: bytes) -> bytes:
        kind = _RAW
        if compression == "snappy":
            import cramjam
            packed = bytes(cramjam.snappy.compress_raw(block))
            if len(packed) < len(block) - len(block) // 8:
                block, kind = packed, _SNAPPY
        handle = varint(len(out)) + varint(len(block))
        out.extend(block + bytes([kind]))
        out.extend(struct.pack("<I", masked_crc32c(block + bytes([kind]))))
        return handle

    index: List[Tuple[bytes, bytes]] = []
    pending: List[Tuple[bytes, bytes]] = []
    size, last = 0, None
    for key, value in entries:
        key, value = bytes(key), bytes(value)
        if last is not None and key <= last:
            raise ValueError(f"table keys must be strictly increasing: {key!r} after {last!r}")
        pending.append((key, value))
        size += len(key) + len(value) + 3
        last = key
        if size >= block_size:
            index.append((key, write_block(_block_bytes(pending, restart_interval))))
            pending, size = [], 0
    if pending:
        index.append((last, write_block(_block_bytes(pending, restart_interval))))
    metaindex = write_block(_block_bytes([], restart_interval))
    index_handle = write_block(_block_bytes(index, 1))
    footer = (metaindex + index_handle).ljust(40, b"\0") + struct.pack("<Q", MAGIC)
    return bytes(out) + footer
