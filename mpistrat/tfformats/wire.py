"""The protocol buffer wire format in pure Python, for where the protobuf package is missing.

``decode(schema, name, data)`` reads a message of type ``name`` from bytes into a
:class:`Message` (attributes named as the fields; repeated fields are lists, packed floats
NumPy arrays, map fields dicts); ``encode(schema, name, fields)`` writes one from a dict.
``schema`` maps each message name to its :class:`Field` list; a field's ``kind`` is a scalar
type (``int32``, ``int64``, ``uint64``, ``bool``, ``enum``, ``string``, ``bytes``,
``fixed32``, ``float``) or another message's name; ``mpistrat.tfformats.messages`` holds
TensorFlow's.
A :class:`Message` answers the few protobuf calls our readers use (``HasField``,
``WhichOneof``, attribute access), so callers need not know which backend parsed it::

    >>> schema = {"Pair": [Field(1, "key", "string"), Field(2, "value", "int64", True)]}
    >>> data = encode(schema, "Pair", {"key": "a", "value": [1, -2]})
    >>> message = decode(schema, "Pair", data)
    >>> message.key, list(message.value)
    ('a', [1, -2])

Malformed input (a varint longer than 10 bytes, a length beyond the end, a group or unknown
wire type) raises :class:`WireError`.
"""

import struct
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Field", "Message", "WireError", "decode", "encode", "read_varint", "varint"]


class Field(NamedTuple):
    """One field of a message: number, name, kind, and how it repeats."""

    number: int
    name: str
    kind: str
    repeated: bool = False
    oneof: Optional[str] = None   # the oneof group it belongs to
    map: bool = False             # a map field: ``kind`` is its entry (``key``, ``value``)


Schema = Dict[str, Sequence[Field]]

_SCALAR_DEFAULTS = {"int32": 0, "int64": 0, "uint64": 0, "bool": False, "enum": 0,
                    "string": "", "bytes": b"", "fixed32": 0, "float": 0.0, "double": 0.0}
_VARINT_KINDS = {"int32", "int64", "uint64", "bool", "enum"}
_WIRE_TYPE = {"fixed32": 5, "float": 5, "double": 1}


class WireError(ValueError):
    """The bytes are not a valid encoding of the message."""


class Message:
    """A decoded message: one attribute per field (defaults for absent ones)."""

    def __init__(self, schema: Schema, name: str):
        object.__setattr__(self, "_schema", schema)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_present", [])
        for field in schema[name]:
            if field.map:
                object.__setattr__(self, field.name, {})
            elif field.repeated:
                object.__setattr__(self, field.name, [])
            elif field.kind in _SCALAR_DEFAULTS:
                object.__setattr__(self, field.name, _SCALAR_DEFAULTS[field.kind])
            # message fields are made on first read (a default, empty message)

    def __getattr__(self, name: str):
        for field in self._schema[self._name]:
            if field.name == name and field.kind not in _SCALAR_DEFAULTS:
                return Message(self._schema, field.kind)
        raise AttributeError(f"{self._name} has no field {name!r}")

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        return name in self._present

    def WhichOneof(self, group: str) -> Optional[str]:  # noqa: N802 - protobuf's name
        members = {f.name for f in self._schema[self._name] if f.oneof == group}
        present = [f for f in self._present if f in members]
        return present[-1] if present else None

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in self._schema[self._name]
                 if f.name in self._present}
        return f"{self._name}({shown})"


def read_varint(data, pos: int, end: int) -> Tuple[int, int]:
    """The unsigned varint at ``data[pos:]`` and the position after it."""
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("a varint runs past the end of the data")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("a varint is longer than 10 bytes")


def varint(value: int) -> bytes:
    """The varint encoding of ``value`` (negative numbers as 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _scalar(kind: str, value: int):
    if kind == "int64":
        return _signed(value, 64)
    if kind in ("int32", "enum"):
        return _signed(value, 32)
    if kind == "bool":
        return value != 0
    return value & ((1 << 64) - 1)


def _packed(kind: str, data, pos: int, end: int) -> list:
    if kind == "float":
        if (end - pos) % 4:
            raise WireError("a packed float field's length is not a multiple of 4")
        return np.frombuffer(bytes(data[pos:end]), dtype="<f4")
    if kind == "fixed32":
        if (end - pos) % 4:
            raise WireError("a packed fixed32 field's length is not a multiple of 4")
        return list(struct.unpack(f"<{(end - pos) // 4}I", bytes(data[pos:end])))
    values = []
    while pos < end:
        raw, pos = read_varint(data, pos, end)
        values.append(_scalar(kind, raw))
    if pos != end:
        raise WireError("a packed field ends inside a varint")
    return values


def decode(schema: Schema, name: str, data, pos: int = 0, end: int = None) -> Message:
    """The message ``name`` encoded in ``data[pos:end]``."""
    end = len(data) if end is None else end
    message = Message(schema, name)
    fields = {field.number: field for field in schema[name]}
    while pos < end:
        tag, pos = read_varint(data, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == 0:
            raw, pos = read_varint(data, pos, end)
            value = ("varint", raw)
        elif wire == 1:
            if pos + 8 > end:
                raise WireError("a fixed64 field runs past the end")
            value, pos = ("fixed64", data[pos:pos + 8]), pos + 8
        elif wire == 5:
            if pos + 4 > end:
                raise WireError("a fixed32 field runs past the end")
            value, pos = ("fixed32", data[pos:pos + 4]), pos + 4
        elif wire == 2:
            length, pos = read_varint(data, pos, end)
            if length > end - pos:
                raise WireError(f"a field of {length} bytes runs past the end")
            value, pos = ("bytes", (pos, pos + length)), pos + length
        else:
            raise WireError(f"wire type {wire} (groups or unknown) is not supported")
        if number in fields:
            _store(schema, message, fields[number], value, data)
    return message


def _store(schema: Schema, message: Message, info: Field, value, data) -> None:
    field, kind, repeated = info.name, info.kind, info.repeated
    wire, payload = value
    if kind in _SCALAR_DEFAULTS:
        if wire == "bytes" and kind in ("string", "bytes"):
            raw = bytes(data[payload[0]:payload[1]])
            item = raw.decode("utf-8", "surrogateescape") if kind == "string" else raw
            items = [item]
        elif wire == "bytes" and repeated:                       # packed numbers
            items = _packed(kind, data, *payload)
        elif wire == "varint" and kind in _VARINT_KINDS:
            items = [_scalar(kind, payload)]
        elif wire == "fixed32" and kind in ("fixed32", "float"):
            items = [struct.unpack("<I" if kind == "fixed32" else "<f", bytes(payload))[0]]
        elif wire == "fixed64" and kind == "double":
            items = [struct.unpack("<d", bytes(payload))[0]]
        else:
            raise WireError(f"field {field!r} of {message._name} has the wrong wire type")
    elif wire == "bytes":
        items = [decode(schema, kind, data, *payload)]
    else:
        raise WireError(f"field {field!r} of {message._name} has the wrong wire type")
    if info.map:
        getattr(message, field)[items[0].key] = items[0].value
    elif repeated:
        current = getattr(message, field)
        if isinstance(items, np.ndarray) or isinstance(current, np.ndarray):
            object.__setattr__(message, field, np.concatenate(
                [np.asarray(current, "<f4"), np.asarray(items, "<f4")]))
        else:
            current.extend(items)
    else:
        object.__setattr__(message, field, items[-1])
    message._present.append(field)


def encode(schema: Schema, name: str, fields: dict) -> bytes:
    """The encoding of message ``name`` with ``fields`` (absent fields keep their defaults)."""
    out: List[bytes] = []
    for number, field, kind, repeated, oneof, is_map in schema[name]:
        if fields.get(field) is None:
            continue
        value = fields[field]
        if is_map:                                      # entries of key and value
            values = [{"key": k, "value": v} for k, v in value.items()]
        else:
            values = list(value) if repeated else [value]
        if kind in _SCALAR_DEFAULTS and repeated and kind not in ("string", "bytes"):
            body = b"".join(_encode_scalar(kind, v) for v in values)
            out.append(varint(number << 3 | 2) + varint(len(body)) + body)
            continue
        for item in values:
            if kind in _SCALAR_DEFAULTS:
                if not repeated and oneof is None and item == _SCALAR_DEFAULTS[kind]:
                    continue      # proto3: defaults are not written (a oneof's member is)
                wire = 2 if kind in ("string", "bytes") else _WIRE_TYPE.get(kind, 0)
                out.append(varint(number << 3 | wire) + _encode_scalar(kind, item))
            else:
                body = encode(schema, kind, item)
                out.append(varint(number << 3 | 2) + varint(len(body)) + body)
    return b"".join(out)


def _encode_scalar(kind: str, value) -> bytes:
    if kind == "string":
        raw = value.encode("utf-8")
        return varint(len(raw)) + raw
    if kind == "bytes":
        return varint(len(value)) + bytes(value)
    if kind == "fixed32":
        return struct.pack("<I", value)
    if kind == "float":
        return struct.pack("<f", value)
    if kind == "double":
        return struct.pack("<d", value)
    return varint(int(value))
