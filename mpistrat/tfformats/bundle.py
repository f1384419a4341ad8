"""TensorFlow's tensor bundle: a checkpoint's ``PREFIX.index`` and its data shards.

``PREFIX.index`` is a sorted table (:mod:`sstable`): the empty key holds a
``BundleHeaderProto`` (number of shards, endianness, version), every other key a
``BundleEntryProto`` (dtype, shape, shard, offset, size, masked CRC-32C). A tensor's bytes
lie in ``PREFIX.data-SSSSS-of-NNNNN`` at that offset: numbers as raw little-endian values;
strings as a varint64 length per element, a masked CRC-32C of the lengths (each taken as a
uint32, or uint64 above 4 GiB), then the bytes of every element; the entry's CRC covers
the lengths as taken, that checksum and the bytes.

``read_index`` validates every entry against the files before anything is read or
allocated (dtype known, shape sane, shard present, bytes inside the shard, sizes that match
dtype and shape); ``decode_value`` checks the CRC and returns a NumPy array (bfloat16 and
float8 through ``ml_dtypes``, strings as an object array of ``bytes``).
``bundle_writer.py`` writes the same format::

    >>> import numpy as np, tempfile, os
    >>> from mpistrat.tfformats import bundle, bundle_writer
    >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
    >>> entries = bundle_writer.write_shard(bundle.data_name(prefix, 0, 1),
    ...                                     [("w", np.arange(3, dtype=np.float32))])
    >>> bundle_writer.write_index(prefix, 1, entries)
    >>> index = bundle.read_index(prefix)
    >>> bundle.read_value(index.entries["w"]).tolist()
    [0.0, 1.0, 2.0]
"""

import math
import os
import stat
import struct
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from mpistrat.errors import DataLossError, InvalidArgumentError, NotFoundError
from mpistrat.safe_files import UnreadableFile, read_regular
from mpistrat.tfformats import messages
from mpistrat.tfformats.crc import crc32c, extend, unmask
from mpistrat.tfformats.tf_dtypes import REFUSED as _REFUSED
from mpistrat.tfformats.tf_dtypes import STRING, dtype_enum, numpy_dtype
from mpistrat.tfformats.slices import decode_slice_key, is_slice_key, plan_pieces
from mpistrat.tfformats.sstable import read_table
from mpistrat.tfformats.wire import WireError, read_varint

__all__ = ["BundleEntry", "BundleIndex", "read_index", "read_value", "decode_value",
           "data_name", "index_name", "is_bundle", "numpy_dtype", "dtype_enum", "refusal",
           "length_bytes", "tf_shape", "STRING", "MAX_INDEX_BYTES"]

MAX_INDEX_BYTES = 1 << 30      # an index this large holds millions of tensors: refused
_MAX_RANK = 254                 # TensorFlow's limit


def index_name(prefix: str) -> str:
    return f"{prefix}.index"


def data_name(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


def is_bundle(prefix: str) -> bool:
    """Whether ``prefix`` names a TensorFlow checkpoint (its ``.index`` is a file)."""
    return os.path.isfile(index_name(os.fspath(prefix)))


@dataclass
class BundleEntry:
    """One tensor of a bundle, validated against its data shard."""

    key: str
    enum: int
    dtype: np.dtype
    shape: Tuple[int, ...]
    file: str
    offset: int
    size: int
    crc: int               # as stored (masked)
    refused: str = ""      # a TensorFlow dtype we cannot hold ("variant", "resource", ...):
                           # listed, never read (``read_value`` names it)
    slices: tuple = ()     # a partitioned tensor: ((starts, stops), slice entry) per slice;
                           # its bytes are the slices' stored bytes one after another

    @property
    def nbytes(self) -> int:
        """Bytes of the value in memory (strings: as stored)."""
        return self.size

    @property
    def count(self) -> int:
        return math.prod(self.shape)


@dataclass
class BundleIndex:
    """A checkpoint's ``.index``: its shards and every entry (key -> :class:`BundleEntry`)."""

    prefix: str
    num_shards: int
    entries: Dict[str, BundleEntry]


def _read_small_file(path: str, limit: int, what: str) -> bytes:
    try:
        return read_regular(path, limit)
    except FileNotFoundError:
        raise NotFoundError(f"{what} {path} does not exist") from None
    except UnreadableFile as err:
        raise DataLossError(f"{what} {path} {err}") from None
    except OSError as err:
        raise DataLossError(f"{what} {path} cannot be read: {err}") from None


def read_index(prefix: str) -> BundleIndex:
    """The validated index of the bundle at ``prefix`` (reads ``PREFIX.index`` only)."""
    prefix = os.fspath(prefix)
    path = index_name(prefix)
    table = read_table(_read_small_file(path, MAX_INDEX_BYTES, "checkpoint index"), path)
    if not table or table[0][0] != b"":
        raise DataLossError(f"{path}: the bundle header (empty key) is missing")
    header = messages.parse("BundleHeaderProto", table[0][1], f"{path}, the bundle header")
    _check_header(header, path)
    shards = [data_name(prefix, k, header.num_shards) for k in range(header.num_shards)]
    sizes: Dict[int, int] = {}
    entries: Dict[str, BundleEntry] = {}
    parts: Dict[str, Dict[tuple, BundleEntry]] = {}   # a sliced tensor's name -> its slices
    sliced = {}                                       # name -> its full entry's proto
    for raw_key, value in table[1:]:
        if is_slice_key(raw_key):
            try:
                name, extents = decode_slice_key(raw_key)
            except (ValueError, UnicodeDecodeError) as err:
                raise DataLossError(f"{path}: an invalid slice key {raw_key[:40]!r}: "
                                    f"{err}") from None
            where = f"{path}, slice {list(extents)} of {name!r}"
            proto = messages.parse("BundleEntryProto", value, where)
            if len(proto.slices):
                raise DataLossError(f"{where}: a slice that is itself sliced")
            parts.setdefault(name, {})[extents] = _entry(f"{name}{list(extents)}", proto,
                                                         shards, sizes, where)
            continue
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise DataLossError(f"{path}: a key is not UTF-8 text ({raw_key[:40]!r})") from None
        where = f"{path}, key {key!r}"
        proto = messages.parse("BundleEntryProto", value, where)
        if len(proto.slices):
            sliced[key] = proto
            continue
        entries[key] = _entry(key, proto, shards, sizes, where)
    _check_claims(list(entries.values()) + [e for p in parts.values() for e in p.values()],
                  {shards[k]: size for k, size in sizes.items()}, path)
    for key, proto in sliced.items():
        entries[key] = _sliced_entry(key, proto, parts.get(key, {}), f"{path}, key {key!r}")
    return BundleIndex(prefix, header.num_shards, entries)


def _sliced_entry(key: str, proto, parts: Dict[tuple, BundleEntry], where: str) -> BundleEntry:
    """A partitioned tensor: its full dtype and shape, and its slices, each found among the
    slice entries with its own dtype and shape, and tiling the full shape exactly."""
    dtype = numpy_dtype(proto.dtype, where)
    if proto.shape.unknown_rank or not 1 <= len(proto.shape.dim) <= _MAX_RANK:
        raise DataLossError(f"{where}: a sliced tensor of invalid rank")
    shape = tuple(int(d.size) for d in proto.shape.dim)
    if any(d < 0 for d in shape) or math.prod(max(d, 1) for d in shape) * dtype.itemsize >= \
            1 << 62:
        raise DataLossError(f"{where}: invalid shape {list(shape)}")
    pieces = plan_pieces(shape, proto.slices, parts, proto.dtype, where)
    if proto.dtype == STRING:
        return BundleEntry(key, proto.dtype, np.dtype("V1"), shape, pieces[0][1].file, 0,
                           sum(p.size for _, p in pieces), 0, "string (partitioned)")
    return BundleEntry(key, proto.dtype, dtype, shape, pieces[0][1].file if pieces else "",
                       0, sum(p.size for _, p in pieces), 0, slices=tuple(pieces))


def _check_claims(entries: List[BundleEntry], sizes: Dict[str, int], path: str) -> None:
    """TensorFlow stores each tensor once: the entries of a shard claim at most its bytes.
    A crafted index whose entries all point at one block would make a restore read (and
    check) that block once per entry: hours of work from a small file."""
    claimed: Dict[str, int] = {}
    for entry in entries:
        claimed[entry.file] = claimed.get(entry.file, 0) + entry.size
    for file, total in claimed.items():
        if total > sizes[file]:
            raise DataLossError(f"{path}: its entries claim {total} bytes of {file}, which "
                                f"holds {sizes[file]}: they overlap, which TensorFlow never "
                                f"writes")


def tf_shape(proto, where: str) -> Tuple[int, ...]:
    """The dims of a ``TensorShapeProto`` by TensorFlow's rule (its reader aborts the process
    on anything else; this names it, ``DataLossError``): a known rank of at most 254 dims,
    none negative, and the product of the dims, taken left to right, never past 2**63 - 1 (so
    ``[0, 2**62, 2**62]`` is a shape, of no element, and ``[2**62, 2**62, 0]`` is not).

        >>> data = messages.serialize("TensorShapeProto", {"dim": [{"size": 0}, {"size": 3}]})
        >>> tf_shape(messages.parse("TensorShapeProto", data, "a test"), "a test")
        (0, 3)
    """
    if proto.unknown_rank or len(proto.dim) > _MAX_RANK:
        raise DataLossError(f"{where}: invalid shape (unknown rank or over {_MAX_RANK} dims)")
    shape = tuple(int(d.size) for d in proto.dim)
    count = 1
    for size in shape:
        if size < 0:
            raise DataLossError(f"{where}: invalid shape {list(shape)}: a negative dimension")
        count *= size
        if count >= 1 << 63:
            raise DataLossError(f"{where}: shape {list(shape)} is too large for any array: "
                                f"its dimensions multiply past 2**63 - 1")
    return shape


def _check_header(header, path: str) -> None:
    if not 1 <= header.num_shards <= 100000:
        raise DataLossError(f"{path}: the bundle header claims {header.num_shards} shards")
    if header.endianness != 0:
        raise InvalidArgumentError(f"{path}: a big-endian bundle; only little-endian "
                                   f"checkpoints are read")
    version = header.version
    if version.min_consumer > 1 or 1 in list(version.bad_consumers) or version.producer < 0:
        raise InvalidArgumentError(f"{path}: bundle format version (producer "
                                   f"{version.producer}, min_consumer {version.min_consumer}) "
                                   f"is newer than this reader (1)")


def _shard_size(shards: List[str], shard: int, sizes: Dict[int, int], where: str) -> int:
    if shard not in sizes:
        path = shards[shard]
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise NotFoundError(f"{where}: data shard {path} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise DataLossError(f"{where}: data shard {path} is not a regular file")
        sizes[shard] = info.st_size
    return sizes[shard]


def _entry(key: str, proto, shards: List[str], sizes: Dict[int, int],
           where: str) -> BundleEntry:
    if proto.dtype in _REFUSED:   # (a tf.data iterator's state, a resource): listed only
        return _refused_entry(key, proto, shards, sizes, where)
    dtype = numpy_dtype(proto.dtype, where)
    shape = tf_shape(proto.shape, where)
    if not 0 <= proto.shard_id < len(shards):
        raise DataLossError(f"{where}: shard {proto.shard_id} of a bundle of {len(shards)}")
    if proto.offset < 0 or proto.size < 0:
        raise DataLossError(f"{where}: negative offset {proto.offset} or size {proto.size}")
    count = math.prod(shape)                       # Python ints: never wraps
    if proto.dtype == STRING:
        low = count + 4 if count else 0            # a varint and the length checksum at least
        if proto.size < low:
            raise DataLossError(f"{where}: {proto.size} bytes cannot hold {count} strings")
    elif proto.size != count * dtype.itemsize:
        raise DataLossError(f"{where}: {proto.size} bytes stored for {dtype.name}"
                            f"{list(shape)}, which needs {count * dtype.itemsize}")
    file_size = _shard_size(shards, proto.shard_id, sizes, where)
    if proto.offset + proto.size > file_size:
        raise DataLossError(f"{where}: bytes [{proto.offset}, {proto.offset + proto.size}) lie "
                            f"beyond the end of {shards[proto.shard_id]} ({file_size} bytes; "
                            f"the shard is truncated?)")
    return BundleEntry(key, proto.dtype, dtype, shape, shards[proto.shard_id],
                       int(proto.offset), int(proto.size), int(proto.crc32c))


def _refused_entry(key: str, proto, shards: List[str], sizes: Dict[int, int],
                   where: str) -> BundleEntry:
    """An entry of a dtype we cannot hold, checked as far as it can be (its bytes lie in
    its shard), so that the checkpoint can be listed and its other values read."""
    shape = tf_shape(proto.shape, where)
    if not 0 <= proto.shard_id < len(shards) or proto.offset < 0 or proto.size < 0:
        raise DataLossError(f"{where}: shard {proto.shard_id}, offset {proto.offset} or size "
                            f"{proto.size} is invalid")
    file_size = _shard_size(shards, proto.shard_id, sizes, where)
    if proto.offset + proto.size > file_size:
        raise DataLossError(f"{where}: bytes beyond the end of {shards[proto.shard_id]}")
    return BundleEntry(key, proto.dtype, np.dtype("V1"), shape, shards[proto.shard_id],
                       int(proto.offset),
                       int(proto.size), int(proto.crc32c), _REFUSED[proto.dtype])


def refusal(entry: BundleEntry, where: str = "") -> InvalidArgumentError:
    """The error for reading an entry of a dtype we cannot hold, naming it."""
    return InvalidArgumentError(f"{where or entry.file}: key {entry.key!r}: TensorFlow dtype "
                                f"{entry.refused} is not supported (numbers, bool, bfloat16, "
                                f"float8 and strings are); it is listed but cannot be read")


# -- values -------------------------------------------------------------------------------
def read_value(entry: BundleEntry) -> np.ndarray:
    """Read and decode ``entry`` from its shard (this process alone)."""
    if entry.refused:
        raise refusal(entry)
    buffer = bytearray(entry.size)
    view = memoryview(buffer)
    position = 0
    for part in [p for _, p in entry.slices] or [entry]:
        _read_into(part, view[position:position + part.size])
        position += part.size
    return decode_value(entry, buffer)


def _read_into(entry: BundleEntry, view: memoryview) -> None:
    with open(entry.file, "rb", buffering=0) as handle:
        got = 0
        while got < entry.size:
            n = os.preadv(handle.fileno(), [view[got:]], entry.offset + got)
            if n <= 0:
                raise DataLossError(f"{entry.file}: short read at offset {entry.offset + got} "
                                    f"for key {entry.key!r} (the shard was truncated?)")
            got += n


def decode_value(entry: BundleEntry, raw) -> np.ndarray:
    """The value of ``entry`` from its ``raw`` stored bytes (CRC checked).

    Numbers are a view of ``raw`` when it is writable (a ``bytearray`` or NumPy buffer).
    """
    if entry.refused:
        raise refusal(entry)
    where = f"{entry.file}, key {entry.key!r}"
    if len(raw) != entry.size:
        raise DataLossError(f"{where}: {len(raw)} bytes read, {entry.size} expected")
    if entry.slices:   # a partitioned tensor: each slice decoded (CRC checked), put in place
        whole = np.empty(entry.shape, dtype=entry.dtype)
        position = 0
        for (starts, stops), part in entry.slices:
            piece = decode_value(part, raw[position:position + part.size])
            whole[tuple(slice(a, b) for a, b in zip(starts, stops))] = piece
            position += part.size
        return whole
    if entry.enum == STRING:
        return _decode_strings(entry, memoryview(raw), where)
    if crc32c(raw) != unmask(entry.crc):
        raise DataLossError(f"{where}: CRC-32C mismatch: the data shard is corrupt")
    if sys.byteorder == "little":
        return _shaped(np.frombuffer(raw, dtype=entry.dtype), entry, where)
    stored = np.frombuffer(raw, dtype=entry.dtype.newbyteorder("<"))
    return _shaped(stored.astype(entry.dtype), entry, where)


def _shaped(flat: np.ndarray, entry: BundleEntry, where: str) -> np.ndarray:
    """``flat`` in the entry's shape. A tensor of no element may have dims NumPy cannot hold
    (``[0, 2**62]`` of float32: their bytes pass 2**63): TensorFlow lists it and its
    ``get_tensor`` fails with NumPy's ``ValueError``; this names it (``InvalidArgumentError``,
    a ``ValueError``)."""
    try:
        return flat.reshape(entry.shape)
    except ValueError as err:
        raise InvalidArgumentError(f"{where}: NumPy cannot hold an array of shape "
                                   f"{list(entry.shape)} and dtype {entry.dtype} ({err})") from None


def length_bytes(length: int) -> bytes:
    return struct.pack("<I", length) if length <= 0xFFFFFFFF else struct.pack("<Q", length)


def _decode_strings(entry: BundleEntry, raw: memoryview, where: str) -> np.ndarray:
    out = np.empty(entry.count, dtype=object)
    if entry.size == 0:                      # TensorFlow writes nothing for some empties
        out[:] = b""
        return _shaped(out, entry, where)
    lengths, pos = [], 0
    try:
        for _ in range(entry.count):
            length, pos = read_varint(raw, pos, len(raw))
            lengths.append(length)
    except WireError as err:
        raise DataLossError(f"{where}: bad string lengths ({err})") from None
    if pos + 4 + sum(lengths) != len(raw):
        raise DataLossError(f"{where}: string lengths add up to {pos + 4 + sum(lengths)} "
                            f"bytes, the entry has {len(raw)}")
    crc = crc32c(b"".join(length_bytes(n) for n in lengths))
    (stored,) = struct.unpack_from("<I", raw, pos)
    if unmask(stored) != crc:
        raise DataLossError(f"{where}: CRC-32C mismatch in the string lengths")
    crc = extend(extend(crc, raw[pos:pos + 4]), raw[pos + 4:])
    if crc != unmask(entry.crc):
        raise DataLossError(f"{where}: CRC-32C mismatch: the data shard is corrupt")
    pos += 4
    for index, length in enumerate(lengths):
        out[index] = bytes(raw[pos:pos + length])
        pos += length
    return _shaped(out, entry, where)
