"""TensorFlow's fast Example parser, rule for rule, one record at a time, in Python.

``tf.io.parse_example`` and its relatives do not parse with protobuf: they walk the wire
bytes with protobuf's ``CodedInputStream`` by rules of their own
(``tensorflow/core/util/example_proto_fast_parsing.cc``), which read some valid encodings
otherwise than protobuf does and accept some invalid ones. This module follows those rules,
so that every byte string gets TensorFlow's values, or an error where TensorFlow raises one
(``InvalidArgumentError``). What they come to, where they differ from protobuf:

* A Feature is read from its first byte: the kind, then one list. Whatever follows the
  list in the Feature is not read (a Feature of two kinds is the first), nor what follows a
  list's first packed run (a list split into runs is its first run; a packed run's last
  1-3 bytes, a float run of a length not a multiple of 4, are not read either). An empty
  Feature has no kind: missing, for a ``FixedLenFeature``.
* Only the features asked for are read past their map entry: one nobody asked for may be
  anything, and a key need not be UTF-8. A key given twice: the last entry wins, but an
  empty last entry leaves the one before it to a fixed-length feature (and, in
  ``parse_single_example``, to every feature; in a batch a VarLen feature's empty last
  entry is empty).
* A length that claims more than its message holds, or 2^31 bytes or more, does not bound
  what is read (protobuf's ``PushLimit`` ignores it): the message is read to its outer
  end; an unknown field that runs past the end ends the record, one of 2^31 bytes or more
  is not skipped at all (what follows its length is read as fields).
* Unknown fields are skipped at the top of an Example or SequenceExample only; in Features,
  map entries, lists and feature lists they are errors, and so are groups anywhere. A map
  entry holds exactly two fields, key or value (an Example's in either order, a
  SequenceExample's key first).
* In a SequenceExample's context and feature lists a packed float run must be a whole number
  of floats, a context Feature that is present but empty has no values, and a step is read
  where the step before it stopped reading (a step of two kinds runs into the next).

A record TensorFlow crashes on (a bytes value claiming 2^31 bytes or more where it copies
it, a ``FixedLenSequenceFeature`` of 0 values an item, a bytes value running past its list
in a SequenceExample's VarLen feature) is refused with an ``InvalidArgumentError`` here.
``example.py`` calls this for ``parse_single_example``'s record and for every batch that
the batch parser (``example_batch.py``) leaves to it, ``sequence_example.py`` for every
SequenceExample::

    >>> from mpistrat.io import example as ex
    >>> run = lambda *values: b"\\x0a" + bytes([len(values)]) + bytes(values)   # packed
    >>> int64_list = b"\\x1a\\x07" + run(1, 2) + run(3)           # [1, 2], then [3]
    >>> entry = b"\\x0a\\x01x\\x12\\x09" + int64_list                # x: that Feature
    >>> record = b"\\x0a\\x10\\x0a\\x0e" + entry
    >>> ex.parse_single_example(record, {"x": ex.VarLenFeature("int64")})["x"].values.tolist()
    [1, 2]
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mpistrat.errors import InvalidArgumentError
from mpistrat.io.sparse import ragged_positions
from mpistrat.tfformats.wire_columns import Unusual, packed_varints

__all__ = ["Stream", "example_entries", "feature_values", "parse_record", "join_pieces",
           "sequence_example"]

_INT_MAX = (1 << 31) - 1
_MASK64 = (1 << 64) - 1
_SIGN = 1 << 63
_KINDS = {0x0A: "string", 0x12: "float32", 0x1A: "int64"}   # a Feature's first byte
_LIST_TAG = {"string": 0x0A, "float32": 0x12, "int64": 0x1A}
_TF_NAMES = {"float32": "float", "int64": "int64", "string": "string"}


class _Crash(InvalidArgumentError):
    """Where TensorFlow itself crashes: refused here, as the data's fault."""


def _varint_at(data: bytes, pos: int, end: int) -> Tuple[int, int]:
    """The varint at ``data[pos:end]`` (at most 10 bytes; its value mod 2^64) and the
    position after it, or ``(-1, pos)``."""
    value = shift = 0
    at = pos
    while at < end and at - pos < 10:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _MASK64, at
        shift += 7
    return -1, pos


def _ints(data: bytes, start: int, stop: int):
    """The varints filling ``data[start:stop]`` as int64 (a list, or an array for a long
    run), or ``None`` (a varint cut by the end, or longer than 10 bytes)."""
    chunk = data[start:stop]
    if not chunk or max(chunk) < 0x80:
        return list(chunk)                          # (every value under 128)
    if len(chunk) > 64:
        try:
            values, _ = packed_varints(data, np.array([start]), np.array([stop]))
        except Unusual:
            return None
        return values.view(np.int64)
    values, value, shift, size = [], 0, 0, 0
    for byte in chunk:
        value |= (byte & 0x7F) << shift
        size += 1
        if byte < 0x80:
            value &= _MASK64
            values.append(value - (1 << 64) if value >= _SIGN else value)
            value = shift = size = 0
        elif size == 10:
            return None
        else:
            shift += 7
    return None if size else values


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGN else value


class Stream:
    """protobuf's ``CodedInputStream`` over ``data[pos:end]`` as TensorFlow uses it: a
    position, a limit (``push_limit`` ignores one past the current limit or of 2^31 bytes
    and more), and reads that answer ``None`` or ``False`` where protobuf's fail."""

    __slots__ = ("data", "pos", "limit")

    def __init__(self, data: bytes, pos: int = 0, end: Optional[int] = None):
        self.data, self.pos = data, pos
        self.limit = len(data) if end is None else end

    def at_end(self) -> bool:
        return self.pos == self.limit

    def expect(self, tag: int) -> bool:
        """``ExpectTag`` of a one-byte tag: the next byte, compared as a byte."""
        if self.pos < self.limit and self.data[self.pos] == tag:
            self.pos += 1
            return True
        return False

    def peek(self) -> int:
        return self.data[self.pos] if self.pos < self.limit else 0

    def push_limit(self, length: int) -> int:
        old = self.limit
        if length <= _INT_MAX and length < old - self.pos:
            self.limit = self.pos + length
        return old

    def varint(self) -> Optional[int]:
        """A varint of at most 10 bytes within the limit (its value mod 2^64), or ``None``."""
        value, self.pos = _varint_at(self.data, self.pos, self.limit)
        return None if value < 0 else value

    def varint32(self) -> Optional[int]:
        value, self.pos = _varint_at(self.data, self.pos, self.limit)
        return None if value < 0 else value & 0xFFFFFFFF

    def tag(self) -> int:
        """``ReadTag``: 0 at the limit or for a malformed varint."""
        value, self.pos = _varint_at(self.data, self.pos, self.limit)
        return 0 if value < 0 else value & 0xFFFFFFFF

    def skip(self, count: int) -> bool:
        if count > _INT_MAX:                  # (negative as protobuf's int: not moved)
            return False
        if count <= self.limit - self.pos:
            self.pos += count
            return True
        self.pos = self.limit
        return False

    def raw(self, count: int) -> Optional[bytes]:
        """``ReadRaw`` of ``count`` bytes (``None`` past the limit; a count of 2^31 or more
        is where TensorFlow crashes)."""
        if count > _INT_MAX:
            raise _Crash("a length of 2^31 bytes or more (TensorFlow crashes on it)")
        pos = self.pos
        if count <= self.limit - pos:
            self.pos = pos + count
            return self.data[pos:pos + count]
        self.pos = self.limit
        return None

    def fixed(self, size: int) -> bool:
        if self.limit - self.pos >= size:
            self.pos += size
            return True
        self.pos = self.limit
        return False

    def string(self) -> Optional[Tuple[int, int]]:
        """``ParseString``: the span of a length-prefixed string within the limit."""
        length = self.varint32()
        if length is None:
            return None
        pos = self.pos
        if length == 0:
            return pos, pos
        if pos >= self.limit or self.limit - pos < length:
            return None
        self.pos = pos + length
        return pos, pos + length

    def skip_field(self) -> bool:
        """``SkipExtraneousTag``: an unknown field (never a group)."""
        wire = self.tag() & 7
        if wire == 0:
            return self.varint() is not None
        if wire == 1:
            return self.fixed(8)
        if wire == 2:
            length = self.varint32()
            if length is None:
                return False
            self.skip(length)                  # (TensorFlow ignores whether it could)
            return True
        if wire == 5:
            return self.fixed(4)
        return False


def _canonical(data: bytes, start: int, stop: int, dtype: str):
    """The values of the Feature ``data[start:stop]`` (its kind byte checked by the caller)
    when it is in the canonical encoding, one list filling it (numbers in one packed run
    filling the list): ``(piece, count)``, else ``None``. Where it answers, TensorFlow's
    rules give the same values whatever they are."""
    pos = start + 1
    if pos >= stop:
        return None
    length = data[pos]
    pos += 1
    if length >= 0x80:
        length, pos = _varint_at(data, pos - 1, stop)
    if length < 0 or pos + length != stop:
        return None
    if dtype == "string":
        values = []
        while pos < stop:
            if data[pos] != 0x0A or pos + 1 >= stop:
                return None
            size = data[pos + 1]
            pos += 2
            if size >= 0x80:
                size, pos = _varint_at(data, pos - 1, stop)
            if size < 0 or size > stop - pos:
                return None
            values.append(data[pos:pos + size])
            pos += size
        return values, len(values)
    if pos == stop:
        return (b"" if dtype == "float32" else []), 0
    if data[pos] != 0x0A or pos + 1 >= stop:
        return None
    size = data[pos + 1]
    pos += 2
    if size >= 0x80:
        size, pos = _varint_at(data, pos - 1, stop)
    if size < 0 or pos + size != stop:
        return None
    if dtype == "float32":
        return None if size % 4 else (data[pos:stop], size // 4)
    values = _ints(data, pos, stop)
    return None if values is None else (values, len(values))


# --------------------------------------------------------------------------- Example
def example_entries(data: bytes) -> Optional[List[Tuple[bytes, int, int]]]:
    """``ParseExample``: every map entry of every ``features`` field, in order, as (key,
    the Feature's span), or ``None`` where TensorFlow cannot parse the record. (The
    canonical encoding is read here; anything else by ``_entries_exact``, stream by
    stream as TensorFlow reads it.)"""
    end, pos, entries = len(data), 0, []
    append = entries.append
    while pos < end:
        if data[pos] != 0x0A or pos + 1 >= end:
            return _entries_exact(data)
        size = data[pos + 1]
        pos += 2
        if size >= 0x80:
            size, pos = _varint_at(data, pos - 1, end)
        if size < 0 or size > end - pos:
            return _entries_exact(data)
        stop = pos + size
        while pos < stop:                           # map entries: key, then value
            if data[pos] != 0x0A or pos + 1 >= stop:
                return _entries_exact(data)
            size = data[pos + 1]
            at = pos + 2
            if size >= 0x80:
                size, at = _varint_at(data, pos + 1, stop)
            if size < 0 or size > stop - at:
                return _entries_exact(data)
            entry_stop = at + size
            if at + 1 >= entry_stop or data[at] != 0x0A:
                return _entries_exact(data)
            size = data[at + 1]
            key = at + 2
            if size >= 0x80:
                size, key = _varint_at(data, at + 1, entry_stop)
            if size < 0 or key + size + 1 >= entry_stop or data[key + size] != 0x12:
                return _entries_exact(data)
            key_stop = key + size
            size = data[key_stop + 1]
            value = key_stop + 2
            if size >= 0x80:
                size, value = _varint_at(data, key_stop + 1, entry_stop)
            if size < 0 or value + size != entry_stop:
                return _entries_exact(data)
            append((data[key:key_stop], value, entry_stop))
            pos = entry_stop
    return entries


def _entries_exact(data: bytes) -> Optional[List[Tuple[bytes, int, int]]]:
    stream, entries = Stream(data), []
    while stream.pos != stream.limit:
        if stream.expect(0x0A):
            length = stream.varint32()
            if length is None:
                return None
            outer = stream.push_limit(length)
            while stream.pos != stream.limit:
                if not stream.expect(0x0A) or not _entry(stream, entries):
                    return None
            stream.limit = outer
        elif not stream.skip_field():
            return None
    return entries


def _entry(stream: Stream, entries: list) -> bool:
    """``ParseFeatureMapEntry``: two fields, key and value in either order (the one not
    given is empty), and nothing else."""
    length = stream.varint32()
    if length is None:
        return False
    outer = stream.push_limit(length)
    key = value = (stream.pos, stream.pos)
    for _ in range(2):
        tag = stream.tag()
        if tag == 0x0A:
            key = stream.string()
            if key is None:
                return False
        elif tag == 0x12:
            value = stream.string()
            if value is None:
                return False
        else:
            return False
    if stream.pos != stream.limit:
        return False
    stream.limit = outer
    entries.append((stream.data[key[0]:key[1]], value[0], value[1]))
    return True


def _list_stream(data: bytes, start: int, stop: int) -> Optional["Stream"]:
    """A stream limited to the length-delimited list at ``start``, or ``None`` when its
    length cannot be read."""
    stream = Stream(data, start, stop)
    length = stream.varint32()
    if length is None:
        return None
    stream.push_limit(length)
    return stream


def float_list(data: bytes, start: int, stop: int, cap: Optional[int] = None):
    """``ParseFloatList`` of the list after a Feature's kind byte: ``(little-endian bytes,
    count)`` or ``None``. ``cap``: the room of a fixed-length feature (TensorFlow's
    ``LimitedArraySlice``): the count may pass it (an error to the caller), the bytes not."""
    stream = _list_stream(data, start, stop)
    if stream is None:
        return None
    if stream.at_end():
        return b"", 0
    tag = stream.peek()
    if tag == 0x0A:                                    # packed: the first run only
        stream.pos += 1
        packed = stream.varint32()
        if packed is None:
            return None
        stream.push_limit(packed)
        count = packed // 4
        size = 4 * count if cap is None else min(4 * min(count, cap), packed)
        raw = stream.raw(size)
        return None if raw is None else (raw, count)
    if tag == 0x0D:                                    # unpacked: to the list's end
        count = (stream.limit - stream.pos) // 5
        pieces = []
        while not stream.at_end():
            if not stream.expect(0x0D):
                return None
            pos = stream.pos
            if not stream.fixed(4):
                return None
            pieces.append(data[pos:pos + 4])
        return b"".join(pieces), count
    return None


def int64_list(data: bytes, start: int, stop: int, cap: Optional[int] = None):
    """``ParseInt64List``: ``(int64 values, count)`` or ``None``."""
    stream = _list_stream(data, start, stop)
    if stream is None:
        return None
    if stream.at_end():
        return [], 0
    tag = stream.peek()
    if tag == 0x0A:
        stream.pos += 1
        packed = stream.varint32()
        if packed is None:
            return None
        stream.push_limit(packed)
        values = _ints(data, stream.pos, stream.limit)
        return None if values is None else (values, len(values))
    if tag == 0x08:
        values = []
        while not stream.at_end():
            if not stream.expect(0x08):
                return None
            value = stream.varint()
            if value is None:
                return None
            values.append(_signed(value))
        return values, len(values)
    return None


def bytes_list(data: bytes, start: int, stop: int, cap: Optional[int] = None):
    """``ParseBytesList``: ``(list of bytes, count)`` or ``None`` (past ``cap`` too)."""
    stream = _list_stream(data, start, stop)
    if stream is None:
        return None
    values = []
    while not stream.at_end():
        if not stream.expect(0x0A):
            return None
        size = stream.varint32()
        if size is None or (cap is not None and len(values) >= cap):
            return None
        value = stream.raw(size)
        if value is None:
            return None
        values.append(value)
    return values, len(values)


def _count_bytes(data: bytes, start: int, stop: int) -> bool:
    """``GetNumElementsInBytesList``: whether the list's values can all be skipped."""
    stream = _list_stream(data, start, stop)
    if stream is None:
        return False
    while not stream.at_end():
        if not stream.expect(0x0A):
            return False
        size = stream.varint32()
        if size is None or not stream.skip(size):
            return False
    return True


_LISTS = {"float32": float_list, "int64": int64_list, "string": bytes_list}


def feature_values(data: bytes, start: int, stop: int, dtype: str, cap=None):
    """The values of the list of the Feature ``data[start:stop]`` (its kind byte checked by
    the caller) by ``ParseFloatList`` and its kin: ``(piece, count)`` or ``None``."""
    return _canonical(data, start, stop, dtype) or _LISTS[dtype](data, start + 1, stop, cap)


def _type_error(spec, kind: str, index: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Key: {spec.name}.  Data types don't match. Expected type: {_TF_NAMES[spec.dtype]}, "
        f"Actual type: {_TF_NAMES[kind]} (example {index})")


def _parse_error(spec, index: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"Key: {spec.name}, Index: {index}.  Can't parse serialized "
                                f"Example (example {index})")


def parse_record(data, specs, by_key: Dict[bytes, int], index: int, single: bool) -> list:
    """One record's values for every spec (pieces as ``example._Spec`` holds them: float32
    as bytes, int64 a list or array, strings a list; a fixed feature's default where it is
    missing), by ``FastParseSingleExample`` (``single``) or by ``FastParseSerializedExample``
    (a batch's record): their rules differ for an empty Feature."""
    if type(data) is not bytes:
        if not isinstance(data, (bytearray, memoryview, np.bytes_)):
            raise InvalidArgumentError(f"example {index}: expected serialized bytes, got "
                                       f"{type(data).__name__}")
        data = bytes(data)
    entries = example_entries(data)
    if entries is None:
        raise InvalidArgumentError(f"Could not parse example input (example {index})")
    pieces: List[Any] = [None] * len(specs)
    for key, start, stop in reversed(entries):
        d = by_key.get(key)
        if d is None:
            continue
        spec = specs[d]
        if start == stop:                 # an empty Feature: no kind
            if spec.fixed or spec.sequence or single or pieces[d] is not None:
                continue                  # (an earlier entry of the key may count)
            pieces[d] = spec.empty()      # a batch's VarLen feature: empty
            continue
        kind = _KINDS.get(data[start])
        if kind is None:
            raise InvalidArgumentError(f"Key: {spec.name}, Index: {index}.  Unsupported "
                                       f"datatype (example {index})")
        if pieces[d] is not None:
            continue                      # the last entry wins
        if kind != spec.dtype:
            raise _type_error(spec, kind, index)
        if spec.fixed:
            got = feature_values(data, start, stop, kind, spec.size)
            if got is None:
                raise _parse_error(spec, index)
            if got[1] != spec.size:
                raise InvalidArgumentError(
                    f"Key: {spec.name}, Index: {index}.  Number of {_TF_NAMES[kind]} "
                    f"values != expected.  Values size: {got[1]} but output shape: "
                    f"{list(spec.shape)}")
        else:
            got = _canonical(data, start, stop, kind)
            if got is None:
                if single and kind == "string" and not _count_bytes(data, start + 1, stop):
                    raise _parse_error(spec, index)
                got = _LISTS[kind](data, start + 1, stop)
                if got is None:
                    raise _parse_error(spec, index)
            if spec.sequence:
                if not spec.size:
                    raise _Crash(f"feature {spec.name!r}: items of 0 values (TensorFlow "
                                 f"crashes on them)")
                if got[1] % spec.size:
                    raise InvalidArgumentError(
                        f"Key: {spec.name}, Index: {index}.  Number of {_TF_NAMES[kind]} "
                        f"values is not a multiple of stride length. Saw {got[1]} values but "
                        f"output shape is: [?,{','.join(map(str, spec.shape))}]")
        pieces[d] = got[0]
    for d, spec in enumerate(specs):
        if pieces[d] is None:
            pieces[d] = spec.missing(index)
    return pieces


def join_pieces(pieces: list, dtype: str) -> np.ndarray:
    """Pieces of values (float32 bytes, int64 lists or arrays, lists of bytes) as one flat
    array."""
    if dtype == "float32":
        return np.frombuffer(b"".join(pieces), "<f4").astype(np.float32)
    if dtype == "int64":
        if all(type(p) is list for p in pieces):
            return np.array([v for p in pieces for v in p], np.int64)
        return np.concatenate([np.asarray(p, np.int64) for p in pieces])
    flat = [value for piece in pieces for value in piece]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out


# --------------------------------------------------------------------------- SequenceExample
def _feature(stream: Stream, dtype: str) -> Tuple[int, Any]:
    """``ParseBytesFeature`` / ``ParseFloatFeature`` / ``ParseInt64Feature`` (as the fill
    pass reads: bytes values copied): ``(count, piece)`` of the Feature at ``stream``,
    count -1 where it is not one of ``dtype``."""
    if not stream.expect(_LIST_TAG[dtype]):
        return -1, None
    length = stream.varint32()
    if length is None:
        return -1, None
    if length == 0:
        return 0, (b"" if dtype == "float32" else [])
    outer = stream.push_limit(length)
    if dtype == "string":
        values = []
        while not stream.at_end():
            if not stream.expect(0x0A):
                return -1, None
            size = stream.varint32()
            value = None if size is None else stream.raw(size)
            if value is None:
                return -1, None
            values.append(value)
        piece: Any = values
    else:
        tag = stream.peek()
        if tag == 0x0A:                                   # packed
            stream.pos += 1
            packed = stream.varint32()
            if packed is None:
                return -1, None
            inner = stream.push_limit(packed)
            start, stop = stream.pos, stream.limit
            if dtype == "float32":
                if (stop - start) % 4:
                    return -1, None             # (a float cut by the run's end)
                piece = stream.data[start:stop]
            else:
                piece = _ints(stream.data, start, stop)
                if piece is None:
                    return -1, None
            stream.pos, stream.limit = stop, inner
        elif tag == (0x0D if dtype == "float32" else 0x08):   # unpacked
            values = []
            while not stream.at_end():
                if not stream.expect(tag):
                    return -1, None
                if dtype == "float32":
                    pos = stream.pos
                    if not stream.fixed(4):
                        return -1, None
                    values.append(stream.data[pos:pos + 4])
                else:
                    value = stream.varint()
                    if value is None:
                        return -1, None
                    values.append(_signed(value))
            piece = b"".join(values) if dtype == "float32" else values
        else:
            return -1, None
    stream.limit = outer
    return (len(piece) // 4 if dtype == "float32" else len(piece)), piece


class _Proto:
    """A requested feature's bytes in each record (the last entry of its key wins)."""

    __slots__ = ("spans", "present")

    def __init__(self, count: int):
        self.spans: List[Optional[Tuple[int, int]]] = [None] * count
        self.present = [False] * count


def _extract(records: List[bytes], context: Dict[bytes, _Proto],
             lists: Dict[bytes, _Proto]) -> None:
    """``ExtractFeaturesFromSequenceExamples``: each requested key's value in each record
    (the canonical encoding read by ``_extract_canonical``, anything else by
    ``_extract_exact``)."""
    for d, data in enumerate(records):
        if not _extract_canonical(data, d, context, lists):
            _extract_exact(data, d, context, lists)


def _extract_canonical(data: bytes, d: int, context: Dict[bytes, _Proto],
                       lists: Dict[bytes, _Proto]) -> bool:
    end, pos = len(data), 0
    while pos < end:
        tag = data[pos]
        target = context if tag == 0x0A else lists if tag == 0x12 else None
        if target is None or pos + 1 >= end:
            return False
        size = data[pos + 1]
        pos += 2
        if size >= 0x80:
            size, pos = _varint_at(data, pos - 1, end)
        if size < 0 or size > end - pos:
            return False
        stop = pos + size
        while pos < stop:                           # map entries: key, then value
            if data[pos] != 0x0A or pos + 1 >= stop:
                return False
            size = data[pos + 1]
            at = pos + 2
            if size >= 0x80:
                size, at = _varint_at(data, pos + 1, stop)
            if size < 0 or size > stop - at:
                return False
            entry_stop = at + size
            if at + 1 >= entry_stop or data[at] != 0x0A:
                return False
            size = data[at + 1]
            key = at + 2
            if size >= 0x80:
                size, key = _varint_at(data, at + 1, entry_stop)
            if size < 0 or key + size + 1 >= entry_stop or data[key + size] != 0x12:
                return False
            key_stop = key + size
            size = data[key_stop + 1]
            value = key_stop + 2
            if size >= 0x80:
                size, value = _varint_at(data, key_stop + 1, entry_stop)
            if size < 0 or value + size != entry_stop:
                return False
            proto = target.get(data[key:key_stop])
            if proto is not None:
                proto.spans[d], proto.present[d] = (value, entry_stop), True
            pos = entry_stop
    return True


def _extract_exact(data: bytes, d: int, context: Dict[bytes, _Proto],
                   lists: Dict[bytes, _Proto]) -> None:
    for proto in list(context.values()) + list(lists.values()):
        proto.spans[d], proto.present[d] = None, False
    stream = Stream(data)
    while not stream.at_end():
        if stream.expect(0x0A):
            target = context
        elif stream.expect(0x12):
            target = lists
        elif not stream.skip_field():
            raise _invalid(d)
        else:
            continue
        length = stream.varint32()
        if length is None:
            raise _invalid(d)
        outer = stream.push_limit(length)
        while not stream.at_end():
            size = stream.varint32() if stream.expect(0x0A) else None
            if size is None:
                raise _invalid(d)
            inner = stream.push_limit(size)
            key = stream.string() if stream.expect(0x0A) else None
            value = stream.string() if key is not None and stream.expect(0x12) else None
            if value is None or not stream.at_end():
                raise _invalid(d)
            stream.limit = inner
            proto = target.get(data[key[0]:key[1]])
            if proto is not None:
                proto.spans[d], proto.present[d] = value, True
        stream.limit = outer


def _invalid(index: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"Invalid protocol message input (example {index})")


def _list_type_error(name, row, dtype, index):
    return InvalidArgumentError(
        f"Name: <unknown>, Feature list: {name}, Index: {row}.  Data types don't match. "
        f"Expected type: {_TF_NAMES[dtype]} (example {index})")


def _steps(data: bytes, span, spec, index: int, dense: bool) -> Tuple[List[int], list]:
    """A feature list's steps, read as both of TensorFlow's passes read them (the count,
    ``GetSequenceFeatureLengths``, and the fill of a dense or sparse list; where either
    fails, an error): each step's count and the pieces of their values."""
    name, dtype, tag = spec.name, spec.dtype, _LIST_TAG[spec.dtype]
    stream = Stream(data, span[0], span[1])
    counts, pieces = [], []
    while stream.pos != stream.limit:
        pos, limit = stream.pos, stream.limit
        if data[pos] == 0x0A and pos + 2 < limit:      # a canonical step: read here
            size = data[pos + 1]
            at = pos + 2
            if size >= 0x80:
                size, at = _varint_at(data, pos + 1, limit)
            if 2 < size <= limit - at and data[at] == tag:
                got = _canonical(data, at, at + size, dtype)
                if got is not None:
                    if dense and got[1] != spec.size:
                        raise _dense_count_error(spec, len(counts), got[1], index)
                    counts.append(got[1])
                    pieces.append(got[0])
                    stream.pos = at + size
                    continue
        size = stream.varint32() if stream.expect(0x0A) else None
        if size is None:
            raise InvalidArgumentError(f"Error in sequence feature {name} (example {index})")
        if size > 2:
            outer = stream.push_limit(size)
            count, piece = _feature(stream, dtype)
            if count < 0:             # (the count pass's error, or the fill pass's: a bytes
                raise _list_type_error(name, len(counts), dtype, index)   # value cut, or
            stream.limit = outer      # TensorFlow's crash on it in a sparse list)
            pieces.append(piece)
        elif size == 2:
            if not (stream.expect(tag) and stream.varint32() == 0):   # SkipEmptyFeature
                raise _list_type_error(name, len(counts), dtype, index)
            count = 0
        elif size == 1:
            raise InvalidArgumentError(f"Error in sequence feature {name} (example {index})")
        else:
            count = 0
        if dense and count != spec.size:    # (the dense fill pass reads no step of 2 bytes
            raise _dense_count_error(spec, len(counts), count, index)   # or less)
        counts.append(count)
    return counts, pieces


def _dense_count_error(spec, row: int, count: int, index: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Name: <unknown>, Key: {spec.name}, Index: {row}.  Number of values != expected.  "
        f"values size: {count} but output shape: {list(spec.shape)} (example {index})")


def _context_values(data: bytes, span, spec, index: int):
    """A context Feature's ``(count, piece)`` (both passes' errors raised)."""
    start, stop = span
    got = _canonical(data, start, stop, spec.dtype) \
        if data[start] == _LIST_TAG[spec.dtype] else None
    if got is not None:
        return got[1], got[0]
    count, piece = _feature(Stream(data, start, stop), spec.dtype)
    if count < 0:
        raise InvalidArgumentError(
            f"Name: <unknown>, Context feature: {spec.name}.  Data types don't match. "
            f"Expected type: {_TF_NAMES[spec.dtype]} (example {index})")
    return count, piece


def sequence_example(records: List[Any], context_specs: list, sequences: list,
                     batch: bool):
    """``FastParseSequenceExample``: ``(context, sequences, lengths)`` as dicts of NumPy
    arrays and ``(indices, values, dense_shape)`` triples (sparse), ``[batch] +`` each shape
    where ``batch``. ``context_specs`` are ``example._Spec`` (FixedLen and VarLen);
    ``sequences`` objects with ``name``, ``step`` (the ``_Spec`` of one step: its shape and
    dtype), ``dense`` and ``allow_missing``. (Each record is read once: TensorFlow's count
    pass and fill pass answer alike, or both fail, or the fill pass crashes TensorFlow.)"""
    for index, record in enumerate(records):
        if not isinstance(record, (bytes, bytearray, memoryview, np.bytes_)):
            raise InvalidArgumentError(f"example {index}: expected serialized bytes, got "
                                       f"{type(record).__name__}")
    records = [r if type(r) is bytes else bytes(r) for r in records]
    count = len(records)
    context = {spec.key: _Proto(count) for spec in context_specs}
    lists = {seq.step.key: _Proto(count) for seq in sequences}
    _extract(records, context, lists)
    out_context = {}
    for spec in context_specs:
        proto = context[spec.key]
        out_context[spec.name] = (_context_dense if spec.fixed else _context_sparse)(
            records, proto, spec, batch)
    out_lists, lengths = {}, {}
    for seq in sequences:
        proto = lists[seq.step.key]
        if seq.dense:
            out_lists[seq.name], lengths[seq.name] = _list_dense(records, proto, seq, batch)
        else:
            out_lists[seq.name] = _list_sparse(records, proto, seq, batch)
    return out_context, out_lists, lengths


def _context_dense(records, proto: _Proto, spec, batch: bool):
    longest = spec.size if spec.default is not None else 0
    pieces = []
    for d, span in enumerate(proto.spans):
        if not proto.present[d]:
            pieces.append(None)
            continue
        n, piece = _context_values(records[d], span, spec, d) if span[0] != span[1] \
            else (0, spec.empty())            # (present but empty: no values)
        longest = max(longest, n)
        pieces.append((n, piece))
    if longest != spec.size:
        raise InvalidArgumentError(f"Inconsistent max number of elements for feature "
                                   f"{spec.name}: expected {spec.size}, but found {longest}")
    values = []
    for d, got in enumerate(pieces):
        if got is None:
            values.append(spec.missing(d))        # the default, or "required"
        elif got[0] != spec.size:
            raise InvalidArgumentError(f"Unexpected number of elements in example {d} "
                                       f"(feature {spec.name})")
        else:
            values.append(got[1])
    return join_pieces(values, spec.dtype).reshape(
        ((len(records),) if batch else ()) + spec.shape)


def _context_sparse(records, proto: _Proto, spec, batch: bool):
    pieces, lengths = [], np.zeros(len(records), np.int64)
    for d, span in enumerate(proto.spans):
        if span is None or span[0] == span[1]:
            continue
        lengths[d], piece = _context_values(records[d], span, spec, d)
        pieces.append(piece)
    values = join_pieces(pieces, spec.dtype)
    rows, cols = ragged_positions(lengths)
    longest = int(lengths.max()) if len(lengths) else 0
    if batch:
        return (np.stack([rows, cols], axis=1), values,
                np.array([len(records), longest], np.int64))
    return cols.reshape(-1, 1), values, np.array([longest], np.int64)


def _list_dense(records, proto: _Proto, seq, batch: bool):
    spec = seq.step
    if spec.size == 0:
        raise _Crash(f"Feature list '{seq.name}': items of 0 values (TensorFlow crashes on "
                     f"them)")
    per_record, lengths = [], np.zeros(len(records), np.int64)
    for d, span in enumerate(proto.spans):
        if not proto.present[d] and not seq.allow_missing:
            raise InvalidArgumentError(
                f"Name: <unknown>, Feature list '{seq.name}' is required but could not be "
                f"found (example {d}).  Did you mean to set allow_missing=True?")
        if span is None or span[0] == span[1]:
            continue
        counts, pieces = _steps(records[d], span, spec, d, dense=True)
        lengths[d] = len(counts)
        per_record.append((d, pieces))
    longest = int(lengths.max()) if len(lengths) else 0
    out = np.zeros((len(records), longest * spec.size), dtype=spec.numpy)
    if spec.dtype == "string":
        out[...] = b""
    for d, pieces in per_record:
        values = join_pieces(pieces, spec.dtype)
        out[d, :len(values)] = values
    shape = (longest,) + spec.shape
    return out.reshape(((len(records),) if batch else ()) + shape), lengths


def _list_sparse(records, proto: _Proto, seq, batch: bool):
    spec = seq.step
    pieces, step_counts, step_rows, step_records = [], [], [], []
    longest_rows = 0
    for d, span in enumerate(proto.spans):
        if span is None or span[0] == span[1]:
            continue
        counts, mine = _steps(records[d], span, spec, d, dense=False)
        pieces += mine
        step_counts += counts
        step_rows += range(len(counts))
        step_records += [d] * len(counts)
        longest_rows = max(longest_rows, len(counts))
    values = join_pieces(pieces, spec.dtype)
    counts = np.array(step_counts, np.int64)
    of_step, position = ragged_positions(counts)
    columns = [np.array(step_rows, np.int64)[of_step], position]
    longest_cols = int(counts.max()) if len(counts) else 0
    shape = [longest_rows, longest_cols]
    if batch:
        columns.insert(0, np.array(step_records, np.int64)[of_step])
        shape.insert(0, len(records))
    return (np.stack(columns, axis=1).reshape(-1, len(columns)), values,
            np.array(shape, np.int64))
