"""TensorFlow's tensor bundle, written: data shards and the ``PREFIX.index`` (``bundle.py``
reads and validates them)::

    >>> import numpy as np, tempfile, os
    >>> from mpistrat.tfformats import bundle
    >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt-1")
    >>> write_index(prefix, 1, write_shard(bundle.data_name(prefix, 0, 1),
    ...                                    [("b", np.array([b"x", b"yz"], dtype=object))]))
    >>> bundle.read_value(bundle.read_index(prefix).entries["b"]).tolist()
    [b'x', b'yz']
"""

import struct
from typing import List, Sequence, Tuple

import numpy as np

from mpistrat.safe_files import replace_atomically
from mpistrat.tfformats import messages
from mpistrat.tfformats.bundle import STRING, dtype_enum, index_name, length_bytes
from mpistrat.tfformats.crc import crc32c, extend, mask
from mpistrat.tfformats.sstable import build_table
from mpistrat.tfformats.wire import varint

__all__ = ["encode_value", "write_shard", "write_index"]


def encode_value(value) -> Tuple[int, Tuple[int, ...], bytes, int]:
    """``(dtype enum, shape, stored bytes, masked CRC)`` of a NumPy value."""
    value = np.asarray(value)
    enum = dtype_enum(value.dtype)
    if enum != STRING:
        data = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<"),
                                                 copy=False)).tobytes()
        return enum, value.shape, data, mask(crc32c(data))
    items = [bytes(v) if not isinstance(v, str) else v.encode() for v in value.reshape(-1)]
    lengths = b"".join(varint(len(v)) for v in items)
    crc = crc32c(b"".join(length_bytes(len(v)) for v in items))
    checksum = struct.pack("<I", mask(crc))
    body = b"".join(items)
    crc = extend(extend(crc, checksum), body)
    return enum, value.shape, lengths + checksum + body, mask(crc)


def _write_atomically(path: str, chunks) -> None:
    """Write the bytes ``chunks`` yields to ``path``: a temporary of a random name created with
    ``O_EXCL|O_NOFOLLOW``, fsync, rename (``safe_files.py``)."""
    replace_atomically(path, lambda handle: [handle.write(chunk) for chunk in chunks])


def write_shard(path: str, items: Sequence[Tuple[str, np.ndarray]],
                shard: int = 0) -> List[dict]:
    """Write one data shard holding ``items`` (key, value), atomically; the entries for
    ``write_index``."""
    entries: List[dict] = []

    def chunks():
        offset = 0
        for key, value in items:
            enum, shape, data, crc = encode_value(value)
            entries.append({"key": key, "dtype": enum, "shape": {"dim": [
                {"size": int(d)} for d in shape]}, "shard_id": shard, "offset": offset,
                "size": len(data), "crc32c": crc})
            offset += len(data)
            yield data

    _write_atomically(path, chunks())
    return entries


def write_index(prefix: str, num_shards: int, entries: Sequence[dict]) -> None:
    """Write ``PREFIX.index`` for ``entries`` (from ``write_shard``, any shard order)."""
    header = messages.serialize("BundleHeaderProto", {
        "num_shards": num_shards, "endianness": 0, "version": {"producer": 1}})
    rows = [(b"", header)]
    for entry in sorted(entries, key=lambda e: e["key"].encode()):
        fields = {k: v for k, v in entry.items() if k != "key"}
        rows.append((entry["key"].encode(), messages.serialize("BundleEntryProto", fields)))
    _write_atomically(index_name(prefix), [build_table(rows)])
