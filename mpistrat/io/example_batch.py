"""A batch of serialized ``tf.train.Example`` taken apart at once, feature by feature.

``parse_batch`` reads the wire bytes of every record of a batch together with NumPy
(``tfformats.wire_columns``): the records are joined into one buffer, then each level of the
message (Example, Features, each map entry, Feature, the value list) is one vectorised step
over all records, so the cost per record is a few NumPy element operations, not Python
objects per feature per record. Records that all share one layout are read as a matrix
instead (``example_uniform.py``). The result is what ``parse_example`` returns, bit for bit.

It answers ``None`` for a batch it leaves to the exact path (``fast_parsing.py``, TensorFlow's
rules record by record): any record not in the canonical encoding TensorFlow and protobuf
write (unknown fields, unpacked lists, a feature given twice or empty), and every batch that
must raise an error (a missing required feature, a wrong type or count), so that errors are
worded in one place. As TensorFlow, it reads the features asked for and no others (a feature
nobody asked for may hold anything, under any key)::

    >>> from mpistrat.io import example as ex
    >>> data = [ex.serialize_example({"x": [1.5, 2.0], "id": [7]}),
    ...         ex.serialize_example({"x": [3.0, 4.0], "id": [-8]})]
    >>> specs = ex._specs({"x": ex.FixedLenFeature([2], "float32"),
    ...                    "id": ex.VarLenFeature("int64")})
    >>> out = parse_batch(data, specs)
    >>> out["x"].tolist(), out["id"].values.tolist(), out["id"].indices.tolist()
    ([[1.5, 2.0], [3.0, 4.0]], [7, -8], [[0, 0], [1, 0]])
"""

from typing import Any, Dict, List, Optional

import numpy as np

from mpistrat.io.example_uniform import TAGS, JoinedRecords, uniform_columns
from mpistrat.io.sparse import SparseTensorValue, ragged_positions
from mpistrat.tfformats.wire import WireError, read_varint
from mpistrat.tfformats.wire_columns import (Unusual, as_int64, equal_spans, length_delimited,
                                             packed_varints, repeated_fields, spans_bytes,
                                             varints)

__all__ = ["parse_batch"]

_BYTE_STRINGS = {bytes, bytearray, np.bytes_}
_KEEP = np.array([(1 << 8 * n) - 1 for n in range(9)], dtype="<u8")  # the first n bytes


def parse_batch(records: List[Any], specs) -> Optional[Dict[str, Any]]:
    """``parse_example``'s result for ``records`` (bytes), or ``None`` to parse them record
    by record instead (an unusual encoding, or an error to report)."""
    if not records or not set(map(type, records)) <= _BYTE_STRINGS:
        return None                   # (anything else: the exact path takes it, or words why)
    try:
        return _parse(records, specs)
    except Unusual:
        return None


class _Batch:
    """The joined records and their map entries: record, key span and value span."""

    def __init__(self, joined: JoinedRecords):
        self.count, self.data, self.buf = joined.count, joined.data, joined.buf
        buf, lengths = joined.buf, joined.lengths
        stop = np.cumsum(lengths)
        start = stop - lengths
        some = np.flatnonzero(lengths)                   # an empty record: no features
        f_start, f_stop = length_delimited(buf, start[some], stop[some], 0x0A)
        if (f_stop != stop[some]).any():
            raise Unusual("an Example with more than its features")
        owner, e_start, e_stop = repeated_fields(buf, f_start, f_stop, 0x0A)
        self.record = some[owner]
        self.key_start, self.key_stop = length_delimited(buf, e_start, e_stop, 0x0A)
        if (self.key_stop >= e_stop).any():
            raise Unusual("a map entry without its value")
        self.value_start, self.value_stop = length_delimited(buf, self.key_stop, e_stop, 0x12)
        if (self.value_stop != e_stop).any():
            raise Unusual("a map entry with more than a key and a value")
        # each key's length and first 8 bytes as one number: a feature's entries in 3 steps
        self.key_length = self.key_stop - self.key_start
        head = equal_spans(buf, self.key_start, 8).view("<u8").reshape(-1)
        self.key_head = head & _KEEP[np.minimum(self.key_length, 8)]

    def entries_of(self, name: str) -> np.ndarray:
        """The entries whose key is ``name``, in record order (at most one per record)."""
        key = name.encode("utf-8")
        head = int.from_bytes(key[:8], "little")
        found = np.flatnonzero((self.key_head == head) & (self.key_length == len(key)))
        if len(key) > 8 and len(found):                  # the rest of a long key
            window = equal_spans(self.buf, self.key_start[found] + 8, len(key) - 8)
            found = found[(window == np.frombuffer(key[8:], np.uint8)).all(axis=1)]
        if len(found) > 1 and (np.diff(self.record[found]) <= 0).any():
            raise Unusual(f"feature {name!r} given twice in one Example")
        return found


def _same_headers(batch: _Batch, spec, entries: np.ndarray):
    """The payload spans of ``entries`` when all their Features begin with the same bytes
    up to one payload (a fixed-length feature: the list and packed headers are the same in
    every record), found by comparing those bytes at once; else ``None``."""
    start, stop = batch.value_start[entries], batch.value_stop[entries]
    size = stop - start
    if not len(entries) or size.min() != size.max() or not size[0]:
        return None
    first = batch.data[int(start[0]):int(stop[0])]
    try:
        if first[0] != TAGS[spec.kind]:
            return None
        inner, at = read_varint(first, 1, len(first))      # the list's length
        if first[at] != 0x0A:
            return None
        payload, head = read_varint(first, at + 1, len(first))
    except (WireError, IndexError):
        return None
    if inner != len(first) - at or head + payload != len(first):
        return None                   # (more than one value or field in the list)
    window = equal_spans(batch.buf, start, head)
    if not (window == np.frombuffer(first[:head], np.uint8)).all():
        return None
    return start + head, stop


def _lists(buf, start: np.ndarray, stop: np.ndarray, tag: int):
    """The list payloads of Features ``[start, stop)`` that hold one list field ``tag``."""
    list_start, list_stop = length_delimited(buf, start, stop, tag)
    if (list_stop != stop).any():
        raise Unusual("a Feature with more than one list")
    return list_start, list_stop


def _packed(buf, list_start: np.ndarray, list_stop: np.ndarray, floats: bool):
    """The non-empty numeric lists (their indices) and their packed payloads ``(start,
    stop)``: one packed field each, floats a multiple of 4 bytes."""
    some = np.flatnonzero(list_stop > list_start)
    start, stop = length_delimited(buf, list_start[some], list_stop[some], 0x0A)
    if (stop != list_stop[some]).any():
        raise Unusual("a value list with more than its packed values")
    if floats and ((stop - start) % 4).any():
        raise Unusual("packed floats of a length not a multiple of 4")
    return some, start, stop


def _values(batch: _Batch, spec, entries: np.ndarray):
    """The values of ``entries`` (flat, in order) and how many each entry holds."""
    buf = batch.buf
    same = _same_headers(batch, spec, entries)
    if same is not None:                       # one payload each, the same headers
        start, stop = same
        if spec.dtype == "string":
            values = np.empty(len(start), dtype=object)
            values[:] = [batch.data[a:b] for a, b in zip(start.tolist(), stop.tolist())]
            return values, np.ones(len(entries), np.int64)
        if spec.dtype == "float32" and not (stop[0] - start[0]) % 4:
            raw = equal_spans(batch.buf, start, int(stop[0] - start[0]))
            return raw.view("<f4").reshape(-1).astype(np.float32), (stop - start) // 4
        if spec.dtype == "int64":
            return _int64s(batch, spec, start, stop)
    list_start, list_stop = _lists(buf, batch.value_start[entries], batch.value_stop[entries],
                                   TAGS[spec.kind])
    counts = np.zeros(len(entries), np.int64)
    if spec.dtype == "string":
        owner, start, stop = repeated_fields(buf, list_start, list_stop, 0x0A)
        counts += np.bincount(owner, minlength=len(entries))
        values = np.empty(len(start), dtype=object)
        data = batch.data
        values[:] = [data[a:b] for a, b in zip(start.tolist(), stop.tolist())]
        return values, counts
    some, start, stop = _packed(buf, list_start, list_stop, spec.dtype == "float32")
    if spec.dtype == "float32":
        counts[some] = (stop - start) // 4
        raw = spans_bytes(batch.data, start, stop)
        return np.frombuffer(raw, "<f4").astype(np.float32), counts
    values, counts[some] = _int64s(batch, spec, start, stop)
    return values, counts


def _int64s(batch: _Batch, spec, start: np.ndarray, stop: np.ndarray):
    """The packed int64 values in ``[start, stop)`` and how many each span holds."""
    if spec.fixed and spec.size == 1:          # a scalar (a label): one varint each
        values, sizes = varints(batch.buf, start)
        if (start + sizes == stop).all():
            return as_int64(values), np.ones(len(start), np.int64)
    values, counts = packed_varints(batch.data, start, stop)
    return as_int64(values), counts


def _default(spec) -> np.ndarray:
    if spec.dtype == "float32":
        return np.frombuffer(spec.default, "<f4").astype(np.float32)
    out = np.empty(spec.size, dtype=spec.numpy)
    out[:] = spec.default
    return out


def _parse(records: List[bytes], specs) -> Dict[str, Any]:
    joined = JoinedRecords(records)
    count, columns = len(records), uniform_columns(joined, specs)   # one layout: a matrix
    if columns is None:
        batch = _Batch(joined)
        columns = []
        for spec in specs:
            entries = batch.entries_of(spec.name)
            columns.append((batch.record[entries],) + _values(batch, spec, entries))
    return {spec.name: _assembled(spec, count, *column) for spec, column in zip(specs, columns)}


def _assembled(spec, count: int, present: np.ndarray, values: np.ndarray, counts: np.ndarray):
    """A feature's result from the records that hold it, their values (flat, in order) and
    how many each holds."""
    if spec.fixed:
        if (counts != spec.size).any():
            raise Unusual(f"feature {spec.name!r}: a count other than its shape's")
        if len(present) == count:
            column = values.reshape(count, spec.size)
        elif spec.default is None:
            raise Unusual(f"feature {spec.name!r} missing without a default")
        else:
            column = np.empty((count, spec.size), dtype=spec.numpy)
            column[:] = _default(spec)
            column[present] = values.reshape(len(present), spec.size)
        return column.reshape((count,) + spec.shape)
    lengths = np.zeros(count, np.int64)
    lengths[present] = counts
    rows, positions = ragged_positions(lengths)
    return SparseTensorValue(np.stack([rows, positions], axis=1).reshape(-1, 2), values,
                             np.array([count, int(lengths.max())], dtype=np.int64))
