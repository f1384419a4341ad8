"""A batch of serialized ``tf.train.Example`` that share one layout, read as one matrix.

Records that one program wrote from fixed-size features (a float vector, a small label, a
fixed-size string) are often the same bytes but for their values: one length, the same keys
in the same order, the same tags and lengths. ``uniform_columns`` walks the first record in
Python, checks with one NumPy comparison that every record has its bytes everywhere but in
the values, and then reads each feature asked for as a column of the ``[records, length]``
matrix: a few NumPy steps a feature, whatever the batch size.

Any other batch gives ``None`` and ``example_batch`` takes it apart its general way (records
of several lengths or layouts; any encoding but the canonical one, non-minimal varints
included; a key given twice): the walk accepts only what that way reads alike, so the result
is the same bit for bit::

    >>> from mpistrat.io import example as ex
    >>> data = [ex.serialize_example({"x": [1.5, 2.0], "id": [7]}),
    ...         ex.serialize_example({"x": [3.0, 4.0], "id": [8]})]
    >>> specs = ex._specs({"x": ex.FixedLenFeature([2], "float32"),
    ...                    "id": ex.FixedLenFeature([], "int64")})
    >>> [(present.tolist(), values.tolist()) for present, values, _ in
    ...  uniform_columns(JoinedRecords(data), specs)]
    [([0, 1], [7, 8]), ([0, 1], [1.5, 2.0, 3.0, 4.0])]
"""

from typing import List, Optional, Tuple

import numpy as np

from mpistrat.tfformats.wire import WireError, read_varint
from mpistrat.tfformats.wire_columns import Unusual, as_int64, packed_varints

__all__ = ["JoinedRecords", "uniform_columns"]

TAGS = {"bytes_list": 0x0A, "float_list": 0x12, "int64_list": 0x1A}   # Feature's oneof
_NONE = np.zeros(0, np.int64)
_PAD = bytes(10)


class JoinedRecords:
    """A batch's records joined once, for this module and ``example_batch``'s general way:
    ``data`` (the records, then 10 zero bytes: no varint read runs past the end), the same
    bytes as ``uint8`` (``buf``), ``count`` and each record's length (``lengths``)."""

    def __init__(self, records: List[bytes]):
        self.count = len(records)
        self.lengths = np.fromiter(map(len, records), np.int64, self.count)
        self.data = b"".join([*records, _PAD])
        self.buf = np.frombuffer(self.data, np.uint8)


class _Odd(Exception):
    """Not the one canonical layout this module reads."""


def _field(record, at: int, end: int, tag: int) -> Tuple[int, int]:
    """The payload ``(start, stop)`` of ``record``'s length-delimited field ``tag`` at
    ``at``, its length a minimal varint, within ``end``; else ``_Odd``."""
    if at >= end or record[at] != tag:
        raise _Odd
    size, start = read_varint(record, at + 1, end)
    if start - at - 1 != max(1, (size.bit_length() + 6) // 7) or start + size > end:
        raise _Odd                                        # (non-minimal, or past the end)
    return start, start + size


def _entries(record, length: int) -> dict:
    """The record's map entries: key bytes -> the Feature's span."""
    start, stop = _field(record, 0, length, 0x0A)             # Example.features, to the end
    if stop != length:
        raise _Odd
    entries, at = {}, start
    while at < stop:
        e_start, e_stop = _field(record, at, stop, 0x0A)
        k_start, k_stop = _field(record, e_start, e_stop, 0x0A)
        v_start, v_stop = _field(record, k_stop, e_stop, 0x12)
        key = bytes(record[k_start:k_stop])
        if v_stop != e_stop or key in entries:
            raise _Odd
        entries[key] = (v_start, v_stop)
        at = e_stop
    return entries


def _payloads(record, spec, start: int, stop: int) -> List[Tuple[int, int]]:
    """The value payloads of a Feature of ``spec``'s kind: one packed run (or none) for
    numbers, one per string."""
    l_start, l_stop = _field(record, start, stop, TAGS[spec.kind])
    if l_stop != stop:
        raise _Odd
    if spec.dtype == "string":
        spans, at = [], l_start
        while at < l_stop:
            spans.append(_field(record, at, l_stop, 0x0A))
            at = spans[-1][1]
        return spans
    if l_start == l_stop:
        return []
    p_start, p_stop = _field(record, l_start, l_stop, 0x0A)
    if p_stop != l_stop or (spec.dtype == "float32" and (p_stop - p_start) % 4):
        raise _Odd
    return [(p_start, p_stop)]


def uniform_columns(joined: JoinedRecords, specs) -> Optional[List[tuple]]:
    """Per spec ``(records present, values, counts)`` as ``example_batch`` finds them, when
    every record has the first one's layout; else ``None``."""
    count, lengths, data = joined.count, joined.lengths, joined.data
    length = int(lengths[0])
    if not length or lengths.min() != length or lengths.max() != length:
        return None
    first = data[:length]
    try:
        entries = _entries(first, length)
        spans = {spec.name: _payloads(first, spec, *entries[spec.key])
                 for spec in specs if spec.key in entries}
    except (_Odd, WireError, IndexError):
        return None
    structure = np.ones(length, bool)           # every byte but the values must be alike
    for key, (start, stop) in entries.items():  # (a feature not asked for: all of it)
        structure[start:stop] = False
    for spec in specs:
        if spec.key in entries:
            structure[slice(*entries[spec.key])] = True
            for start, stop in spans[spec.name]:
                structure[start:stop] = False
    rows = joined.buf[:count * length].reshape(count, length)
    edges = np.flatnonzero(np.diff(structure, prepend=False, append=False))
    for start, stop in edges.reshape(-1, 2).tolist():     # the runs of structural bytes
        if not (rows[:, start:stop] == rows[0, start:stop]).all():
            return None
    try:
        return [_column(spec, spans.get(spec.name), rows, data, count, length)
                for spec in specs]
    except Unusual:
        return None


def _column(spec, spans, rows: np.ndarray, data: bytes, count: int, length: int) -> tuple:
    everyone = np.arange(count, dtype=np.int64)
    if spans is None:                            # in no record
        return _NONE, _empty(spec), _NONE
    if spec.dtype == "string":
        values = np.empty(count * len(spans), dtype=object)
        bases = range(0, count * length, length)     # (an empty last string starts at
        if len(spans) == 1:                           # the record's length: from 0)
            (a, b), = spans
            values[:] = [data[base + a:base + b] for base in bases]
        else:
            values[:] = [data[base + a:base + b] for base in bases for a, b in spans]
        return everyone, values, np.full(count, len(spans), np.int64)
    start, stop = spans[0] if spans else (0, 0)
    if start == stop:                            # no value in any record (an empty run too)
        return everyone, _empty(spec), np.zeros(count, np.int64)
    payload = rows[:, start:stop]
    if spec.dtype == "float32":
        values = np.ascontiguousarray(payload).view("<f4").reshape(-1).astype(np.float32)
        return everyone, values, np.full(count, (stop - start) // 4, np.int64)
    if payload.max() < 0x80:                     # one byte a value
        return everyone, as_int64(payload.reshape(-1).astype(np.uint64)), \
            np.full(count, stop - start, np.int64)
    if stop - start <= 10 and payload[:, -1].max() < 0x80 and payload[:, :-1].min() >= 0x80:
        values = np.zeros(count, np.uint64)      # one value a record, of the run's bytes
        for step in range(stop - start):
            values |= (payload[:, step] & 0x7F).astype(np.uint64) << np.uint64(7 * step)
        return everyone, as_int64(values), np.ones(count, np.int64)
    values, counts = packed_varints(data, everyone * length + start, everyone * length + stop)
    return everyone, as_int64(values), counts


def _empty(spec) -> np.ndarray:
    if spec.dtype == "string":
        return np.empty(0, dtype=object)
    return np.zeros(0, np.float32) if spec.dtype == "float32" else np.zeros(0, np.int64)
