"""Partitioned (sliced) variables of TensorFlow's bundles: slice keys and reassembly (pure).

A sliced variable ``NAME`` (TF1's ``fixed_size_partitioner``, TF2's ``MaxShardSizePolicy``)
has one index entry under ``NAME`` that holds only its dtype, full shape and the list of its
slices (``TensorSliceProto``: per dimension a start and a length, or no length for the whole
dimension), and one ordinary entry per slice, holding the slice's values, under a binary key:
TensorFlow's OrderedCode of ``(0, NAME, rank, start_0, length_0, start_1, length_1, ...)``,
a whole dimension written as start 0, length -1. This module decodes those keys, turns the
protos into ``(starts, lengths)`` and checks that the slices tile the full shape exactly
(inside it, no overlap, every element covered) before anything is allocated.

    >>> decode_slice_key(b"\\x00v\\x00\\x01\\x01\\x02\\x82\\x82\\x80\\x83")
    ('v', ((2, 2), (0, 3)))
    >>> tile_check((4, 3), [((0, 0), (2, 3)), ((2, 0), (4, 3))], "v")   # (starts, stops)
    >>> decode_signed(bytes([0x3F, 0xBF]), 0)
    (-65, 2)
"""

import math
from typing import Any, Dict, List, Sequence, Tuple

from mpistrat.errors import DataLossError

__all__ = ["decode_slice_key", "decode_signed", "is_slice_key", "extents_of", "tile_check",
           "plan_pieces", "MAX_SLICES"]

MAX_SLICES = 1 << 16       # slices of one variable: TensorFlow writes tens, a crafted file more
Extents = Tuple[Tuple[int, int], ...]     # per dimension (start, length); length -1 = whole


def is_slice_key(raw: bytes) -> bool:
    """Slice keys start with OrderedCode's 0 (a byte 0x00); names never do."""
    return raw[:1] == b"\x00"


def _unsigned(raw: bytes, pos: int) -> Tuple[int, int]:
    if pos >= len(raw) or raw[pos] > 8 or pos + 1 + raw[pos] > len(raw):
        raise ValueError("a truncated or invalid unsigned number")
    length = raw[pos]
    return int.from_bytes(raw[pos + 1:pos + 1 + length], "big"), pos + 1 + length


def _string(raw: bytes, pos: int) -> Tuple[bytes, int]:
    out = bytearray()
    while pos + 1 < len(raw):
        byte, following = raw[pos], raw[pos + 1]
        if byte == 0x00:
            if following == 0x01:
                return bytes(out), pos + 2
            if following != 0xFF:
                raise ValueError("an invalid escape in a string")
            out.append(0x00)
            pos += 2
        elif byte == 0xFF:
            if following != 0x00:
                raise ValueError("an invalid escape in a string")
            out.append(0xFF)
            pos += 2
        else:
            out.append(byte)
            pos += 1
    raise ValueError("an unterminated string")


def _leading_ones(byte: int) -> int:
    count = 0
    while count < 8 and byte & (0x80 >> count):
        count += 1
    return count


# The length bits of an L-byte signed number, as an L-byte big-endian integer.
_HEADERS = {**{n: ((0xFF00 >> n) & 0xFF) << (8 * (n - 1)) for n in range(1, 9)},
            9: 0xFF80 << 56, 10: 0xFFC0 << 64}


def decode_signed(raw: bytes, pos: int) -> Tuple[int, int]:
    """OrderedCode's ``WriteSignedNumIncreasing``: ``(value, next position)``.

    The first bits say the sign (1: >= 0) and the length L in bytes (L ones, then a zero,
    for a value >= 0; inverted for one < 0); the rest of the L bytes is the value in two's
    complement."""
    if pos >= len(raw):
        raise ValueError("a truncated signed number")
    negative = not raw[pos] & 0x80
    flip = 0xFF if negative else 0x00
    length = _leading_ones(raw[pos] ^ flip)
    if length == 8:
        if pos + 1 >= len(raw):
            raise ValueError("a truncated signed number")
        length += _leading_ones(raw[pos + 1] ^ flip)
    if length < 1 or length > 10 or pos + length > len(raw):
        raise ValueError("an invalid signed number")
    value = int.from_bytes(raw[pos:pos + length], "big")
    value ^= _HEADERS[length]
    if negative:
        value -= 1 << (8 * length)
    return value, pos + length


def decode_slice_key(raw: bytes) -> Tuple[str, Extents]:
    """``(variable name, ((start, length), ...))`` from a slice key; ``ValueError`` if it is
    not one."""
    zero, pos = _unsigned(raw, 0)
    if zero != 0:
        raise ValueError("not a slice key (no leading 0)")
    name, pos = _string(raw, pos)
    rank, pos = _unsigned(raw, pos)
    if not 1 <= rank <= 64:
        raise ValueError(f"a slice of rank {rank}")
    extents = []
    for _ in range(rank):
        start, pos = decode_signed(raw, pos)
        length, pos = decode_signed(raw, pos)
        extents.append((start, length))
    if pos != len(raw):
        raise ValueError("bytes after the slice's extents")
    return name.decode("utf-8"), tuple(extents)


def extents_of(proto, rank: int, where: str) -> Extents:
    """A ``TensorSliceProto`` as the extents of its key (a dimension without a length: the
    whole dimension, ``(0, -1)``)."""
    extents = list(proto.extent)
    if len(extents) != rank:
        raise DataLossError(f"{where}: a slice of rank {len(extents)} for a tensor of rank {rank}")
    return tuple((int(e.start), int(e.length)) if e.WhichOneof("has_length") else (0, -1)
                 for e in extents)


def bounds(shape: Sequence[int], extents: Extents) -> Tuple[Tuple[int, int], ...]:
    """``(start, stop)`` per dimension of a slice of a tensor of ``shape``."""
    return tuple((0, d) if length < 0 else (start, start + length)
                 for d, (start, length) in zip(shape, extents))


def tile_check(shape: Sequence[int], slices: List[Tuple[Tuple[int, ...], Tuple[int, ...]]],
               where: str) -> None:
    """The slices ``(starts, stops)`` lie inside ``shape``, do not overlap, and cover every
    element: else ``DataLossError`` naming the first that does not (``where``: the variable).

    The element counts are compared first; only when they add up to the shape's is a mask of
    the shape marked slice by slice (so its size is bounded by the elements the slices hold,
    which the caller has checked against the data's bytes), catching overlaps in time linear
    in the elements."""
    if len(slices) > MAX_SLICES:
        raise DataLossError(f"{where}: {len(slices)} slices, over {MAX_SLICES}")
    covered = 0
    for starts, stops in slices:
        if any(not 0 <= a <= b <= d or (a == b and d > 0)
               for a, b, d in zip(starts, stops, shape)):
            raise DataLossError(f"{where}: slice {list(zip(starts, stops))} lies outside the "
                                f"shape {list(shape)} or is empty")
        covered += math.prod(b - a for a, b in zip(starts, stops))
    if covered != math.prod(shape):
        raise DataLossError(f"{where}: its slices cover {covered} of its {math.prod(shape)} "
                            f"elements (shape {list(shape)})")
    import numpy as np
    mask = np.zeros(tuple(shape), dtype=bool)
    for starts, stops in slices:
        region = tuple(slice(a, b) for a, b in zip(starts, stops))
        if mask[region].any():
            raise DataLossError(f"{where}: slice {list(zip(starts, stops))} overlaps another")
        mask[region] = True


def plan_pieces(shape: Tuple[int, ...], protos, parts: Dict[Extents, Any], enum: int,
                where: str) -> List[Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], Any]]:
    """``((starts, stops), slice entry)`` for each ``TensorSliceProto`` of a sliced tensor of
    ``shape``: its entry found among ``parts`` (extents -> entry) with the tensor's dtype enum
    and the slice's shape, the slices tiling ``shape`` exactly; else ``DataLossError``."""
    if len(protos) > MAX_SLICES:
        raise DataLossError(f"{where}: {len(protos)} slices, over {MAX_SLICES}")
    pieces = []
    for proto in protos:
        extents = extents_of(proto, len(shape), where)
        part = parts.get(extents)
        if part is None:
            raise DataLossError(f"{where}: slice {list(extents)} is listed but its entry is "
                                f"missing from the index")
        spans = bounds(shape, extents)
        want = tuple(b - a for a, b in spans)
        if part.enum != enum or part.shape != want:
            raise DataLossError(f"{where}: slice {list(extents)} holds {part.dtype.name}"
                                f"{list(part.shape)} where {list(want)} of the tensor's dtype "
                                f"belongs")
        pieces.append(((tuple(a for a, _ in spans), tuple(b for _, b in spans)), part))
    tile_check(shape, [p[0] for p in pieces], where)
    return pieces
