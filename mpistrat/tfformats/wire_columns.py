"""The protocol buffer wire format read with NumPy, many messages at once.

Each function takes a byte buffer (``buf``: ``uint8``, followed by at least 10 zero bytes)
and arrays of positions, one per message or field, and does the same step for all of them in
a few NumPy operations: one Python step per *field* of a message, never per message. This is
what makes ``parse_example`` of a batch cost a few µs a record (``mpistrat.io.example``).

Only the canonical encoding is taken apart here: each function returns ``None`` (or raises
:class:`Unusual`) when a message holds anything else (unknown fields, unpacked repeated
scalars, a varint longer than 10 bytes, a length past the end), and the caller then parses
those messages its exact way (``io/fast_parsing.py``: TensorFlow's rules for every
encoding, every error worded)::

    >>> import numpy as np
    >>> buf = np.frombuffer(b"\\x96\\x01\\x05" + bytes(10), np.uint8)
    >>> values, sizes = varints(buf, np.array([0, 2]))
    >>> values.tolist(), sizes.tolist()
    ([150, 5], [2, 1])
    >>> packed_varints(buf.tobytes(), np.array([0]), np.array([3]))[0].tolist()
    [150, 5]
"""

from typing import Tuple

import numpy as np

__all__ = ["Unusual", "varints", "length_delimited", "repeated_fields",
           "spans_bytes", "equal_spans", "packed_varints", "as_int64"]


class Unusual(Exception):
    """Messages this decoder leaves to the caller's exact path (valid or not: it decides)."""


def varints(buf: np.ndarray, pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The varints starting at ``pos`` (``uint64``) and their sizes in bytes: one NumPy
    step per byte of the longest."""
    byte = buf[pos]
    values, sizes = (byte & 0x7F).astype(np.uint64), np.ones(len(pos), np.int64)
    going = np.flatnonzero(byte >= 0x80)
    for step in range(1, 10):
        if not len(going):
            return values, sizes
        byte = buf[pos[going] + step]
        values[going] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * step)
        sizes[going] += 1
        going = going[byte >= 0x80]
    if len(going):
        raise Unusual("a varint longer than 10 bytes")
    return values, sizes


def _lengths(buf: np.ndarray, pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Lengths of fields (varints of at most 4 bytes here: under 256 MiB) as ``int64``,
    and their sizes; a longer one is left to protobuf."""
    byte = buf[pos]
    lengths = byte.astype(np.int64)
    going = np.flatnonzero(byte >= 0x80)
    if not len(going):                                 # (most fields: under 128 bytes)
        return lengths, np.ones(len(pos), np.int64)
    lengths[going] &= 0x7F
    sizes = np.ones(len(pos), np.int64)
    for step in (1, 2, 3):
        byte = buf[pos[going] + step]
        lengths[going] |= (byte & 0x7F).astype(np.int64) << (7 * step)
        sizes[going] += 1
        going = going[byte >= 0x80]
        if not len(going):
            return lengths, sizes
    raise Unusual("a field of 256 MiB or more")


def length_delimited(buf: np.ndarray, pos: np.ndarray, end: np.ndarray,
                     tag: int) -> Tuple[np.ndarray, np.ndarray]:
    """Fields of wire type 2 with the one-byte ``tag`` at ``pos``: their payloads'
    ``(start, stop)``, each within ``end``. (Few NumPy steps: this runs at every level of
    every message; lengths of one and two bytes are read inline.)"""
    if not len(pos):
        return pos, pos
    if (buf[pos] != tag).any():
        raise Unusual(f"another field than tag {tag:#x}")
    first = buf[pos + 1]
    if first.max() < 0x80:
        start = pos + 2
        stop = start + first
    else:
        second = buf[pos + 2].astype(np.int64)
        long = first >= 0x80
        if (second[long] >= 0x80).any():             # three bytes or more: 2 MiB and up
            lengths, sizes = _lengths(buf, pos + 1)
            start = pos + 1 + sizes
            stop = start + lengths
        else:
            start = pos + 2 + long
            stop = start + (first & 0x7F) + (second << 7) * long
    if (stop > end).any():
        raise Unusual("a length past the end of its message")
    return start, stop


def repeated_fields(buf: np.ndarray, start: np.ndarray, stop: np.ndarray,
                    tag: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Messages ``[start, stop)`` made only of repeated length-delimited fields ``tag``:
    each field's owner (index into ``start``) and payload ``(start, stop)``, in order."""
    owners, starts, stops = [], [], []
    pos, owner = start.astype(np.int64), np.arange(len(start), dtype=np.int64)
    live = pos < stop
    pos, owner = pos[live], owner[live]
    while len(pos):
        a, b = length_delimited(buf, pos, stop[owner], tag)
        owners.append(owner), starts.append(a), stops.append(b)
        live = b < stop[owner]
        pos, owner = b[live], owner[live]
    if not owners:
        return (np.zeros(0, np.int64),) * 3
    if len(owners) == 1:
        return owners[0], starts[0], stops[0]
    if len(owners[-1]) == len(start):            # as many fields in every message: interleave
        count = len(owners)
        return (np.repeat(owners[0], count), np.stack(starts, axis=1).reshape(-1),
                np.stack(stops, axis=1).reshape(-1))
    starts = np.concatenate(starts)
    order = np.argsort(starts, kind="stable")   # the messages lie in order in the buffer
    return np.concatenate(owners)[order], starts[order], np.concatenate(stops)[order]


def spans_bytes(data: bytes, start: np.ndarray, stop: np.ndarray) -> bytes:
    """The bytes of the spans ``[start, stop)`` of ``data``, span after span (one slice per
    span: cheaper than gathering byte by byte)."""
    return b"".join([data[a:b] for a, b in zip(start.tolist(), stop.tolist())])


def equal_spans(buf: np.ndarray, start: np.ndarray, length: int) -> np.ndarray:
    """The spans ``[start, start + length)`` of ``buf`` as rows of a ``uint8`` array (one
    gather through a strided view: faster than slicing when every span has one length)."""
    rows = np.lib.stride_tricks.as_strided(buf, (max(len(buf) - length + 1, 0), length),
                                           (buf.strides[0], buf.strides[0]), writeable=False)
    return rows[start]


def packed_varints(data: bytes, start: np.ndarray,
                   stop: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The varints packed in each span ``[start, stop)`` of ``data``: all values
    (``uint64``, span after span) and how many each span holds."""
    data = np.frombuffer(spans_bytes(data, start, stop), np.uint8)
    if not len(data):
        return np.zeros(0, np.uint64), np.zeros(len(start), np.int64)
    if data.max() < 0x80:                   # every value under 128: one byte each
        return data.astype(np.uint64), stop - start
    last = data < 0x80
    ends = np.cumsum(stop - start) - 1
    if not last[ends[stop > start]].all():
        raise Unusual("a packed varint cut by the end of its field")
    first = np.empty(len(data), bool)             # the first byte of each value
    first[0], first[1:] = True, last[:-1]
    heads = np.flatnonzero(first)
    size = np.diff(np.append(heads, len(data)))
    if (size > 10).any():
        raise Unusual("a varint longer than 10 bytes")
    step = np.arange(len(data), dtype=np.int64) - np.repeat(heads, size)
    parts = (data & 0x7F).astype(np.uint64) << (7 * step).astype(np.uint64)
    values = np.bitwise_or.reduceat(parts, heads)
    lengths = stop - start
    counts = np.zeros(len(start), np.int64)
    full = lengths > 0
    counts[full] = np.add.reduceat(last.astype(np.int64), (np.cumsum(lengths) - lengths)[full])
    return values, counts


def as_int64(values: np.ndarray) -> np.ndarray:
    """``uint64`` varint values as ``int64`` (two's complement, as ``int64`` fields are)."""
    return values.view(np.int64)
