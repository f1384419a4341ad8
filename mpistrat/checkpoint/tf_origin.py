"""What a checkpoint converted from TensorFlow keeps of its origin, so that it converts back to
the same TensorFlow files.

``python -m mpistrat convert`` writes, beside each value, the TensorFlow key it came from
(``mpistrat_tf_key``) and the variable's own name (``mpistrat_tf_full_name``); on the file,
the source's object graph when it had one (``mpistrat_tf_object_graph``: the serialized
``TrackableObjectGraph`` as hex text, without the attributes of values left out, with its
CRC-32 in ``mpistrat_tf_object_graph_crc32``). Converted back, the values take their
original keys and the graph is written as it was, so TensorFlow restores the file into the
original objects, and a TF1 checkpoint (no graph) keeps its TF1 names for ``Saver``. All
of it is read as hostile: names are bounded text, the graph is checked against the file's
size and its CRC before it is decoded::

    >>> attrs = graph_attrs(b"\\x0a\\x00")
    >>> attrs[GRAPH_ATTR], attrs[GRAPH_CRC_ATTR]
    ('0a00', 3140942453)
    >>> decode_graph(attrs[GRAPH_ATTR], attrs[GRAPH_CRC_ATTR], 4096, "a test")
    b'\\n\\x00'
"""

import zlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from mpistrat.checkpoint.dtypes import TF_NAME_ATTR
from mpistrat.errors import DataLossError

__all__ = ["TFOrigin", "TF_KEY_ATTR", "GRAPH_ATTR", "GRAPH_CRC_ATTR", "value_attrs", "graph_attrs",
           "entry_names", "decode_graph", "read_graph"]

TF_KEY_ATTR = "mpistrat_tf_key"
GRAPH_ATTR = "mpistrat_tf_object_graph"
GRAPH_CRC_ATTR = "mpistrat_tf_object_graph_crc32"
_MAX_NAME = 1 << 16       # characters of a key or a name (TensorFlow's: a few hundred)


@dataclass(frozen=True)
class TFOrigin:
    """What a checkpoint keeps of TensorFlow, by our object paths: each value's TensorFlow
    name (``full_name``) and key, and the serialized object graph (``None``: not kept)."""

    names: Optional[Dict[str, str]] = None
    keys: Optional[Dict[str, str]] = None
    graph: Optional[bytes] = None


def value_attrs(full_name: Optional[str], key: Optional[str]) -> Dict[str, str]:
    """The attributes of a converted value: its TensorFlow name and key, where known::

        >>> value_attrs("", "w/.ATTRIBUTES/VARIABLE_VALUE")
        {'mpistrat_tf_key': 'w/.ATTRIBUTES/VARIABLE_VALUE'}
    """
    attrs = {}
    if full_name:
        attrs[TF_NAME_ATTR] = full_name
    if key:
        attrs[TF_KEY_ATTR] = key
    return attrs


def graph_attrs(graph: Optional[bytes]) -> Dict[str, object]:
    """The file attributes holding a serialized object graph (none without one)."""
    if graph is None:
        return {}
    return {GRAPH_ATTR: bytes(graph).hex(), GRAPH_CRC_ATTR: zlib.crc32(graph)}


def _text(value, where: str, name: str) -> str:
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise DataLossError(f"{where}: attribute {name} is not UTF-8 text") from None
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME:
        raise DataLossError(f"{where}: attribute {name} is not a name")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DataLossError(f"{where}: attribute {name} is not UTF-8 text") from None
    return value


def entry_names(attrs, where: str) -> Tuple[str, str]:
    """``(TensorFlow full name, TensorFlow key)`` of a dataset's attributes (``""`` where
    absent); ``DataLossError`` naming ``where`` if either is not a name::

        >>> entry_names({"mpistrat_tf_key": "café".encode()}, "a test")
        ('', 'café')
    """
    return tuple(_text(attrs[name], where, name) if name in attrs else ""
                 for name in (TF_NAME_ATTR, TF_KEY_ATTR))


def decode_graph(text, crc, file_size: int, where: str) -> bytes:
    """The graph bytes from the attributes' values, checked: hex text of at most the file's
    size, whose CRC-32 is ``crc``."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if not isinstance(text, str) or len(text) % 2 or len(text) > 2 * file_size:
        raise DataLossError(f"{where}: attribute {GRAPH_ATTR} is not the hex text of a graph "
                            f"(at most twice the file's {file_size} bytes)")
    try:
        graph = bytes.fromhex(text)
    except ValueError:
        raise DataLossError(f"{where}: attribute {GRAPH_ATTR} is not hex text") from None
    if isinstance(crc, np.generic):
        crc = crc.item()
    if not isinstance(crc, int) or zlib.crc32(graph) != crc:
        raise DataLossError(f"{where}: attribute {GRAPH_ATTR} does not match its CRC-32 "
                            f"({GRAPH_CRC_ATTR}): the file is corrupt")
    return graph


def read_graph(final: str) -> Optional[bytes]:
    """The object graph kept in the checkpoint file ``final``, or ``None`` (this process).

        graph = read_graph("ours/ckpt-7.h5")   # bytes of a TrackableObjectGraph, checked
    """
    from mpistrat.checkpoint.openfile import OpenFile
    handle = OpenFile(final)
    try:
        with handle.h5() as f:
            if GRAPH_ATTR not in f.attrs:
                return None
            if GRAPH_CRC_ATTR not in f.attrs:
                raise DataLossError(f"{final}: attribute {GRAPH_CRC_ATTR} is missing")
            return decode_graph(f.attrs[GRAPH_ATTR], f.attrs[GRAPH_CRC_ATTR], handle.size,
                                final)
    finally:
        handle.close()
