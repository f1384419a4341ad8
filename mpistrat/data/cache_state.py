"""What a ``cache()`` holds, as the bytes a distributed iterator's checkpoint carries.

tf.data saves a memory cache with its iterator: the whole cache once complete, else the
elements written so far together with the position of its input (``cache_dataset_ops.cc``:
``MemoryIterator`` and ``MemoryWriterIterator``), so a restored iterator yields the cached
elements and never computes them again. mpistrat does the same, so that a ``map`` below the
cache that calls a random generator without a seed gives the same values after a resume. What the
``Cache`` nodes of one rank's pipeline hold (``Contents``: the rows of a row plan, the slices
and sizes of batches of a batch plan, or the elements of a sequential iteration, complete or
so far) is that rank's *section*::

    b"mpistrat-cache-1", uint64 length of the header, the JSON header, the leaves' bytes

and the value an iterator saves is every rank's section, as a checkpoint holds each value
once, the same on every rank (``join_sections``)::

    b"mpistrat-caches1", uint64 ranks, uint64 section offsets (ranks + 1), the sections

It is bounded: a save whose sections hold more than ``LIMIT_BYTES`` in all is refused (by
``DistributedIterator``, naming this limit).

Leaves are NumPy arrays and scalars of numbers, bools, ml_dtypes and datetime64/timedelta64;
Python bools, ints and floats; ``bytes`` and ``str`` (and object arrays of them). Structure is
dicts (``str`` or ``int`` keys), lists, tuples and namedtuples of a module's top level.
Anything else is a ``TypeError`` naming it when saving. Elements of one structure and of
equal leaf shapes are stored as one array per leaf. There is no pickle: a checkpoint file is
input, so a section is read field by field and anything that does not add up is a
``DataLossError``::

    >>> import numpy as np
    >>> held = Contents(rows={3: {"x": np.float32(0.5), "id": np.arange(2)}, 5: {
    ...     "x": np.float32(1.5), "id": np.arange(2) + 2}})
    >>> back = decode_section(encode_section([held, Contents()]))
    >>> back[0].rows[5]["x"], back[0].rows[5]["id"].tolist(), back[1].empty
    (np.float32(1.5), [2, 3], True)

A resume at another width cannot give each rank its own rows back: ``merge`` joins the ranks'
sections, and refuses (``ValueError``) where ranks hold different values for the same row (a
map below the cache that is not deterministic computed them anew on each rank)::

    >>> a, b = Contents(rows={0: np.float64(0.25)}), Contents(rows={0: np.float64(0.75)})
    >>> merge([[a], [Contents(rows={1: np.float64(2.0)})]])[0].rows
    {0: np.float64(0.25), 1: np.float64(2.0)}
    >>> merge([[a], [b]])
    Traceback (most recent call last):
    ...
    ValueError: ranks 0 and 1 hold different values for row 0 of the first cache()
"""

import collections
import hashlib
import json
import re
import struct
import sys
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from mpistrat.data.rows import Rows
from mpistrat.errors import DataLossError

__all__ = ["Contents", "LIMIT_BYTES", "encode_section", "decode_section", "join_sections",
           "split_sections", "merge"]

LIMIT_BYTES = 1 << 30        # the most a checkpoint saves with one iterator (all ranks)
SECTION_MAGIC = b"mpistrat-cache-1"
VALUE_MAGIC = b"mpistrat-caches1"
_DEPTH = 64                  # structure nested deeper is refused (and never read)
_FREE_ROWS = 1 << 16         # stacked rows of no bytes at all: at most this many
_PLAIN = re.compile(r"^[<>|](b1|i1|i2|i4|i8|u1|u2|u4|u8|f2|f4|f8|c8|c16)$")
_TIME = re.compile(r"^[<>][mM]8(\[(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?$")
_FIXED = re.compile(r"^([<>]U|\|S)[1-9][0-9]{0,6}$")     # NumPy's fixed-width strings
_ML_DTYPES = ("bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
              "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
              "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "int4", "uint4", "int2", "uint2")
_DICTS = {"d": dict, "o": collections.OrderedDict}


class Contents:
    """What one ``Cache`` node holds on one rank (nothing, by default)."""

    __slots__ = ("rows", "slices", "sizes", "elements", "complete")

    def __init__(self, rows=None, slices=None, sizes=None, elements=None,
                 complete: bool = False):
        self.rows: Dict[int, Any] = dict(rows or {})          # row plan: index -> element
        self.slices: Dict[tuple, Rows] = dict(slices or {})   # batch plan: (i, a, b) -> rows
        self.sizes: Dict[int, int] = dict(sizes or {})        # batch plan: batch -> its rows
        self.elements: Optional[List[Any]] = None if elements is None else list(elements)
        self.complete = bool(complete)     # sequential: the whole iteration (else so far)

    @property
    def empty(self) -> bool:
        return not (self.rows or self.slices or self.sizes or self.elements)


# -- writing ------------------------------------------------------------------------------
class _Payload:
    """The leaves' bytes of a section, and references to them."""

    def __init__(self):
        self.chunks: List[bytes] = []
        self.size = 0

    def raw(self, data: bytes) -> dict:
        ref = {"at": self.size, "n": len(data)}
        self.chunks.append(data)
        self.size += len(data)
        return ref

    def array(self, array: np.ndarray, where: str) -> dict:
        return {"d": _dtype_text(array.dtype, where), "s": list(array.shape),
                **self.raw(np.ascontiguousarray(array).tobytes())}


def _dtype_text(dtype: np.dtype, where: str) -> str:
    if _PLAIN.match(dtype.str) or _TIME.match(dtype.str) or _FIXED.match(dtype.str):
        return dtype.str
    if dtype.name in _ML_DTYPES and dtype == _ml_dtype(dtype.name):
        return f"ml:{dtype.name}"
    raise TypeError(f"{where} holds an array of dtype {dtype}, which a checkpoint cannot save "
                    f"(numbers, bools, ml_dtypes, datetime64/timedelta64, bytes and strings only)")


def _ml_dtype(name: str) -> Optional[np.dtype]:
    try:
        import ml_dtypes
    except ImportError:
        return None
    kind = getattr(ml_dtypes, name, None)
    return None if kind is None else np.dtype(kind)


def _text_leaf(value, kind: str, payload: _Payload) -> dict:
    data = value if kind == "y" else value.encode("utf-8", "surrogatepass")
    return {"k": kind, "np": isinstance(value, np.generic), **payload.raw(bytes(data))}


def _leaf(payload: _Payload, leaf: Any, where: str) -> dict:
    if isinstance(leaf, (bytes, str)):
        return _text_leaf(leaf, "y" if isinstance(leaf, bytes) else "u", payload)
    if isinstance(leaf, np.ndarray) and leaf.dtype == object:
        items = leaf.reshape(-1).tolist()
        kind = "y" if all(isinstance(i, bytes) for i in items) else \
            "u" if all(isinstance(i, str) for i in items) else None
        if kind is None:
            raise TypeError(f"{where} holds an object array of {_kinds(items)}, which a "
                            f"checkpoint cannot save (bytes or str only)")
        data = [i if kind == "y" else i.encode("utf-8", "surrogatepass") for i in items]
        return {"k": "o" + kind, "s": list(leaf.shape),
                "lens": payload.array(np.array([len(d) for d in data], np.int64), where),
                **payload.raw(b"".join(data))}
    if isinstance(leaf, np.ndarray):
        return {"k": "a", **payload.array(leaf, where)}
    if isinstance(leaf, np.generic):
        return {"k": "g", **payload.array(np.asarray(leaf), where)}
    if isinstance(leaf, bool):
        return {"k": "pb", "v": bool(leaf)}
    if isinstance(leaf, int):
        return {"k": "pi", "v": int(leaf)}
    if isinstance(leaf, float):
        return {"k": "pf", **payload.array(np.array(leaf, np.float64), where)}
    raise TypeError(f"{where} holds a value of type {_name(type(leaf))}, which a checkpoint "
                    f"cannot save (NumPy arrays and scalars, Python numbers, bytes and str "
                    f"only)")


def _kinds(items) -> str:
    return ", ".join(sorted({_name(type(i)) for i in items})) or "nothing"


def _name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else \
        f"{cls.__module__}.{cls.__qualname__}"


def _resolve(module: str, qualname: str) -> Optional[type]:
    """The class ``module.qualname`` if its module is imported already (nothing is imported:
    a checkpoint names it)."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None) if part.isidentifier() else None
    return found if isinstance(found, type) else None


def _tree(value: Any, leaf: Callable[[Any], dict], where: str, depth: int = 0) -> dict:
    """The structure of ``value``, each leaf described by ``leaf(value)``, in the order
    ``_leaves`` gives them."""
    if depth > _DEPTH:
        raise TypeError(f"{where} is nested deeper than {_DEPTH} levels")
    if isinstance(value, dict):
        kind = next((k for k, cls in _DICTS.items() if type(value) is cls), None)
        keys = list(value)
        if kind is None or not all(type(k) in (str, int) for k in keys):
            raise TypeError(f"{where} holds a {_name(type(value))} with keys of "
                            f"{_kinds(keys)}, which a checkpoint cannot save (dicts with str "
                            f"or int keys only)")
        return {"t": kind, "k": [[type(k) is int, k] for k in keys],
                "v": [_tree(value[k], leaf, where, depth + 1) for k in keys]}
    if isinstance(value, (list, tuple)):
        items = [_tree(v, leaf, where, depth + 1) for v in value]
        if type(value) in (list, tuple):
            return {"t": "l" if type(value) is list else "t", "v": items}
        cls = type(value)
        if not hasattr(value, "_fields") or _resolve(cls.__module__, cls.__qualname__) is not cls:
            raise TypeError(f"{where} holds a {_name(cls)}, which a checkpoint cannot save "
                            f"(a namedtuple defined at the top level of a module, lists and "
                            f"tuples only)")
        return {"t": "n", "m": cls.__module__, "q": cls.__qualname__, "v": items}
    return {"t": "x", "x": leaf(value)}


def _leaves(value: Any) -> List[Any]:
    """The leaves of ``value`` in ``_tree``'s order (dicts in their own order)."""
    if isinstance(value, dict):
        return [x for k in value for x in _leaves(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    return [value]


def _shape_of(value: Any) -> Any:
    """What elements must share to be stored as one array per leaf (``None``: not so)."""
    if isinstance(value, dict):
        parts = tuple(_shape_of(v) for v in value.values())
        return None if None in parts else (type(value), tuple(value), parts)
    if isinstance(value, (list, tuple)):
        parts = tuple(_shape_of(v) for v in value)
        return None if None in parts else (type(value), parts)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return ("a", value.dtype, value.shape)
    if isinstance(value, np.generic) and not isinstance(value, (bytes, str)):
        return ("g", value.dtype)
    return None


def _row_bytes(leaves: List[Any]) -> List[int]:
    return [np.asarray(leaf).nbytes for leaf in leaves]


def _elements(payload: _Payload, elements: List[Any], where: str) -> dict:
    """Elements as one array per leaf when they agree in structure, dtypes and shapes (and
    every leaf's row has bytes, so a count read back is bounded by the bytes), else one by
    one."""
    shapes = {_shape_of(e) for e in elements[:1]}
    if len(elements) > 1 and None not in shapes and all(_row_bytes(_leaves(elements[0]))) and \
            all(_shape_of(e) in shapes for e in elements[1:]):
        columns = zip(*[_leaves(e) for e in elements])
        specs = iter([{"k": "c" + ("a" if isinstance(column[0], np.ndarray) else "g"),
                       **payload.array(np.stack([np.asarray(v) for v in column]), where)}
                      for column in columns])
        return {"count": len(elements), "columns": _tree(elements[0], lambda _: next(specs),
                                                         where)}
    return {"items": [_tree(e, lambda x: _leaf(payload, x, where), where) for e in elements]}


def _rows(payload: _Payload, rows: Rows, where: str) -> dict:
    if rows.is_stacked and (rows.count <= _FREE_ROWS or any(
            b // max(rows.count, 1) for b in _row_bytes(_leaves(rows.stacked)))):
        return {"count": rows.count,
                "stacked": _tree(rows.stacked, lambda x: _leaf(payload, x, where), where)}
    return {"list": _elements(payload, rows.elements(), where)}


def _contents(payload: _Payload, held: Contents, where: str) -> dict:
    entry: Dict[str, Any] = {}
    if held.rows:
        order = sorted(held.rows)
        entry["rows"] = {"index": payload.array(np.array(order, np.int64), where),
                         "of": _elements(payload, [held.rows[i] for i in order], where)}
    if held.slices:
        keys = sorted(held.slices)
        entry["slices"] = {"keys": payload.array(np.array(keys, np.int64).reshape(-1, 3),
                                                 where),
                           "of": [_rows(payload, held.slices[k], where) for k in keys]}
    if held.sizes:
        entry["sizes"] = payload.array(np.array(sorted(held.sizes.items()),
                                                np.int64).reshape(-1, 2), where)
    if held.elements is not None:
        entry["elements"] = {"complete": held.complete,
                             "of": _elements(payload, held.elements, where)}
    return entry


def encode_section(caches: List[Contents]) -> bytes:
    """One rank's section: what each of its pipeline's caches holds (``TypeError`` naming
    what cannot be saved)."""
    payload = _Payload()
    entries = [_contents(payload, held, f"the {_ordinal(k)} cache() of the pipeline")
               for k, held in enumerate(caches)]
    header = json.dumps({"caches": entries}, separators=(",", ":"), allow_nan=False).encode()
    return b"".join([SECTION_MAGIC, struct.pack("<Q", len(header)), header] + payload.chunks)


def _ordinal(k: int) -> str:
    return ("first", "second", "third")[k] if k < 3 else f"{k + 1}th"


def join_sections(sections: List[bytes]) -> np.ndarray:
    """The saved value: every rank's section, in rank order."""
    offsets = np.cumsum([0] + [len(s) for s in sections]).astype("<u8")
    head = VALUE_MAGIC + struct.pack("<Q", len(sections)) + offsets.tobytes()
    return np.frombuffer(b"".join([head] + list(sections)), np.uint8)


# -- reading ------------------------------------------------------------------------------
class _Damaged(Exception):
    """A field of a section that does not add up (becomes a ``DataLossError``)."""


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise _Damaged(what)


def _int(value: Any, what: str, low: int = 0) -> int:
    _check(type(value) is int and value >= low, f"{what} is not an integer >= {low}")
    return value


def _dtype(text: Any) -> np.dtype:
    _check(isinstance(text, str), "a dtype is not a string")
    if _PLAIN.match(text) or _TIME.match(text) or _FIXED.match(text):
        return np.dtype(text)
    _check(text.startswith("ml:") and text[3:] in _ML_DTYPES, f"dtype {text[:40]!r} is unknown")
    found = _ml_dtype(text[3:])
    _check(found is not None, f"dtype {text[3:]} needs ml_dtypes, which is not installed")
    return found


class _Reader:
    def __init__(self, payload: memoryview):
        self.payload = payload

    def raw(self, ref: Any) -> memoryview:
        _check(isinstance(ref, dict), "a leaf is not an object")
        at, n = _int(ref.get("at"), "an offset"), _int(ref.get("n"), "a length")
        _check(at + n <= len(self.payload), "a leaf lies past the end of the section")
        return self.payload[at:at + n]

    def array(self, ref: dict) -> np.ndarray:
        dtype = _dtype(ref.get("d"))
        shape = ref.get("s")
        _check(isinstance(shape, list) and len(shape) <= 32, "a shape is not a list")
        shape = tuple(_int(d, "a dimension") for d in shape)
        data = self.raw(ref)
        _check(len(data) == int(np.prod(shape, dtype=object)) * dtype.itemsize,
               f"a leaf of shape {shape} and dtype {dtype} has {len(data)} bytes")
        array = np.frombuffer(data, dtype).reshape(shape).copy()   # (not the whole value)
        array.flags.writeable = False      # cached arrays are read-only (cache.py)
        return array

    def leaf(self, spec: dict) -> Any:
        kind = spec.get("k")
        if kind in ("y", "u"):
            data = bytes(self.raw(spec))
            value: Any = data if kind == "y" else data.decode("utf-8", "surrogatepass")
            if spec.get("np") is True:
                value = np.bytes_(value) if kind == "y" else np.str_(value)
            return value
        if kind in ("oy", "ou"):
            lengths = self.array(spec.get("lens"))
            _check(lengths.dtype == np.int64 and lengths.ndim == 1 and (lengths >= 0).all(),
                   "string lengths are not int64")
            data = bytes(self.raw(spec))
            _check(int(lengths.sum()) == len(data), "string lengths do not add up")
            shape = spec.get("s")
            _check(isinstance(shape, list) and int(np.prod([_int(d, "a dimension")
                                                            for d in shape], dtype=object))
                   == len(lengths), "an object array's shape does not match its items")
            bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
            items = [data[a:b] if kind == "oy" else data[a:b].decode("utf-8", "surrogatepass")
                     for a, b in zip(bounds, bounds[1:])]
            out = np.empty(len(items), dtype=object)
            out[:] = items
            out = out.reshape(tuple(shape))
            out.flags.writeable = False
            return out
        if kind == "a":
            return self.array(spec)
        if kind == "g":
            array = self.array(spec)
            _check(array.ndim == 0, "a NumPy scalar is not 0-d")
            return array[()]
        if kind == "pb":
            _check(type(spec.get("v")) is bool, "a bool is not a bool")
            return spec["v"]
        if kind == "pi":
            _check(type(spec.get("v")) is int, "an int is not an int")
            return spec["v"]
        if kind == "pf":
            array = self.array(spec)
            _check(array.dtype == np.float64 and array.ndim == 0, "a float is not float64")
            return float(array)
        raise _Damaged(f"a leaf of unknown kind {str(kind)[:20]!r}")


def _untree(spec: Any, leaf: Callable[[dict], Any], depth: int = 0) -> Any:
    _check(isinstance(spec, dict) and depth <= _DEPTH, "a structure is not an object")
    kind, items = spec.get("t"), spec.get("v")
    if kind == "x":
        _check(isinstance(spec.get("x"), dict), "a leaf is not an object")
        return leaf(spec["x"])
    _check(isinstance(items, list), "a structure has no items")
    values = [_untree(v, leaf, depth + 1) for v in items]
    if kind in _DICTS:
        keys = spec.get("k")
        _check(isinstance(keys, list) and len(keys) == len(values), "a dict's keys")
        for pair in keys:
            _check(isinstance(pair, list) and len(pair) == 2 and
                   (type(pair[1]) is int if pair[0] is True else type(pair[1]) is str),
                   "a dict key is not a str or int")
        return _DICTS[kind]((pair[1], v) for pair, v in zip(keys, values))
    if kind == "l":
        return values
    if kind == "t":
        return tuple(values)
    _check(kind == "n", f"a structure of unknown kind {str(kind)[:20]!r}")
    module, qualname = spec.get("m"), spec.get("q")
    _check(isinstance(module, str) and isinstance(qualname, str), "a namedtuple's name")
    cls = _resolve(module, qualname)
    if cls is None or not issubclass(cls, tuple) or len(getattr(cls, "_fields", ())) != \
            len(values):
        raise _Damaged(f"the namedtuple {module}.{qualname} of the cached elements is not "
                       f"defined here (import its module before restoring)")
    return cls(*values)


class _Column:
    """A leaf of stored columns: row ``j`` of each element is ``array[j]``."""

    __slots__ = ("array", "scalar")

    def __init__(self, array: np.ndarray, scalar: bool):
        self.array, self.scalar = array, scalar

    def row(self, j: int) -> Any:
        return self.array[j] if self.scalar else self.array[j, ...]   # (0-d rows stay arrays)


def _replaced(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt with ``leaf(x)`` for each leaf (dicts in their own order)."""
    if isinstance(value, dict):
        return type(value)((k, _replaced(v, leaf)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_replaced(v, leaf) for v in value]
        if type(value) is list:
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return leaf(value)


def _read_elements(reader: _Reader, spec: Any) -> List[Any]:
    _check(isinstance(spec, dict), "a list of elements is not an object")
    if "items" in spec:
        _check(isinstance(spec["items"], list), "elements are not a list")
        return [_untree(e, reader.leaf) for e in spec["items"]]
    count = _int(spec.get("count"), "a count of elements")

    def column(ref: dict) -> _Column:
        _check(ref.get("k") in ("ca", "cg"), "a column of unknown kind")
        array = reader.array(ref)
        _check(array.ndim >= 1 and array.shape[0] == count and
               (array.nbytes >= count > 0), "a column's rows")
        return _Column(array, ref["k"] == "cg")

    template = _untree(spec.get("columns"), column)
    return [_replaced(template, lambda c, j=j: c.row(j)) for j in range(count)]


def _read_rows(reader: _Reader, spec: Any) -> Rows:
    _check(isinstance(spec, dict), "rows are not an object")
    if "list" in spec:
        return Rows.of_items(_read_elements(reader, spec["list"]))
    count = _int(spec.get("count"), "a count of rows")
    stacked = _untree(spec.get("stacked"), reader.leaf)
    leaves = _leaves(stacked)
    for leaf in leaves:
        _check(isinstance(leaf, np.ndarray) and leaf.ndim >= 1 and leaf.shape[0] == count,
               "stacked rows of another count")
    _check(count <= _FREE_ROWS or any(leaf.nbytes >= count for leaf in leaves),
           "stacked rows of no bytes, too many")
    return Rows.stacked_as(stacked, count)


def _read_contents(reader: _Reader, entry: Any) -> Contents:
    _check(isinstance(entry, dict), "a cache's entry is not an object")
    held = Contents()
    if "rows" in entry:
        index = reader.array(entry["rows"].get("index"))
        elements = _read_elements(reader, entry["rows"].get("of"))
        _check(index.dtype == np.int64 and index.ndim == 1 and len(index) == len(elements),
               "row indices do not match the rows")
        held.rows = dict(zip(index.tolist(), elements))
    if "slices" in entry:
        keys = reader.array(entry["slices"].get("keys"))
        parts = entry["slices"].get("of")
        _check(keys.dtype == np.int64 and keys.ndim == 2 and keys.shape[1] == 3 and
               isinstance(parts, list) and len(parts) == len(keys), "slices of batches")
        held.slices = {tuple(k): _read_rows(reader, p) for k, p in zip(keys.tolist(), parts)}
    if "sizes" in entry:
        sizes = reader.array(entry["sizes"])
        _check(sizes.dtype == np.int64 and sizes.ndim == 2 and sizes.shape[1] == 2,
               "sizes of batches")
        held.sizes = {int(i): int(n) for i, n in sizes.tolist()}
    if "elements" in entry:
        _check(type(entry["elements"].get("complete")) is bool, "a cache's completeness")
        held.elements = _read_elements(reader, entry["elements"].get("of"))
        held.complete = entry["elements"]["complete"]
    return held


def decode_section(data) -> List[Contents]:
    """What each cache held, from one rank's section (``DataLossError`` if it is damaged)."""
    view = memoryview(bytes(data))
    try:
        _check(bytes(view[:16]) == SECTION_MAGIC and len(view) >= 24, "no section header")
        length = struct.unpack("<Q", view[16:24])[0]
        _check(24 + length <= len(view), "the header lies past the end of the section")
        header = json.loads(bytes(view[24:24 + length]).decode("utf-8"))
        _check(isinstance(header, dict) and isinstance(header.get("caches"), list),
               "the header lists no caches")
        reader = _Reader(view[24 + length:])
        return [_read_contents(reader, entry) for entry in header["caches"]]
    except (_Damaged, ValueError, TypeError, KeyError, AttributeError, RecursionError,
            OverflowError, MemoryError) as err:
        raise DataLossError(f"the saved contents of a dataset iterator's cache() are damaged: "
                            f"{err}") from None


def split_sections(value: Any) -> List[memoryview]:
    """Every rank's section of a saved value (``DataLossError`` if it is damaged)."""
    data = np.asarray(value)
    raw = memoryview(data.tobytes()) if data.dtype == np.uint8 and data.ndim == 1 else \
        memoryview(b"")
    head = len(VALUE_MAGIC) + 8
    ranks = struct.unpack("<Q", raw[16:24])[0] if len(raw) >= head and \
        bytes(raw[:16]) == VALUE_MAGIC else None
    if ranks is None or head + 8 * (ranks + 1) > len(raw):
        raise DataLossError("the saved contents of a dataset iterator's cache() are damaged: "
                            "no header of the ranks' sections")
    offsets = np.frombuffer(raw[head:head + 8 * (ranks + 1)], "<u8").astype(np.int64)
    body = raw[head + 8 * (ranks + 1):]
    if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != len(body):
        raise DataLossError("the saved contents of a dataset iterator's cache() are damaged: "
                            "the ranks' sections do not add up")
    return [body[a:b] for a, b in zip(offsets.tolist(), offsets[1:].tolist())]


# -- another width ------------------------------------------------------------------------
def _digest(describe: Callable[[_Payload], dict]) -> bytes:
    payload = _Payload()
    spec = json.dumps(describe(payload), separators=(",", ":")).encode()
    return hashlib.blake2b(b"".join([spec] + payload.chunks), digest_size=16).digest()


def _element_digest(element: Any) -> bytes:
    return _digest(lambda p: _tree(element, lambda x: _leaf(p, x, "an element"), "an element"))


def merge(sections: List[List[Contents]]) -> List[Contents]:
    """What each cache holds when the ranks' sections are joined, for a resume at another
    width: every row, batch slice or element any rank held. ``ValueError`` where two ranks
    hold different values for the same row (or element), where a batch is held only in part
    (the rest would be computed anew next to the cached part), or where the sequential
    iterations differ."""
    counts = {len(s) for s in sections}
    if len(counts) > 1:
        raise DataLossError("the saved contents of a dataset iterator's cache() are damaged: "
                            "the ranks saved different numbers of caches")
    return [_merge_one([s[k] for s in sections], _ordinal(k)) for k in range(counts.pop())] \
        if counts else []


def _agreed(found: dict, key, value, digest: bytes, rank: int, what: str) -> None:
    if key in found and found[key][0] != digest:
        raise ValueError(f"ranks {found[key][2]} and {rank} hold different values for {what}")
    found.setdefault(key, (digest, value, rank))


def _merge_one(parts: List[Contents], which: str) -> Contents:
    rows: dict = {}
    slices: dict = {}
    sizes: dict = {}
    for rank, held in enumerate(parts):
        for index, element in held.rows.items():
            _agreed(rows, index, element, _element_digest(element), rank,
                    f"row {index} of the {which} cache()")
        for key, part in held.slices.items():
            _agreed(slices, key, part, _digest(lambda p: _rows(p, part, "a batch")), rank,
                    f"rows {key[1]}:{key[2]} of batch {key[0]} of the {which} cache()")
        for index, size in held.sizes.items():
            _agreed(sizes, index, size, str(size).encode(), rank,
                    f"the size of batch {index} of the {which} cache()")
    merged = Contents(rows={i: v[1] for i, v in rows.items()},
                      sizes={i: v[1] for i, v in sizes.items()})
    merged.slices = _whole_batches({k: v[1] for k, v in slices.items()}, merged.sizes, which)
    merged.elements, merged.complete = _longest([p for p in parts if p.elements is not None],
                                                which)
    return merged


def _whole_batches(slices: Dict[tuple, Rows], sizes: Dict[int, int], which: str):
    """The slices of each batch joined into the whole batch (the ranks of another width ask
    for other slices of it: ``cache._Memo`` cuts them from the whole)."""
    batches: Dict[int, list] = {}
    for (index, start, stop), part in slices.items():
        if stop > start:
            batches.setdefault(index, []).append((start, stop, part))
    whole = {}
    for index, pieces in sorted(batches.items()):
        pieces.sort(key=lambda p: p[:2])
        size = sizes.get(index, pieces[-1][1])
        ends = [0] + [p[1] for p in pieces]
        if [p[0] for p in pieces] != ends[:-1] or ends[-1] != size:
            held = ", ".join(f"{a}:{b}" for a, b, _ in pieces)
            raise ValueError(f"batch {index} of the {which} cache() is held in pieces that do "
                             f"not make it whole (rows {held} of {size}): its other rows "
                             f"would be computed anew next to the cached ones")
        whole[(index, 0, size)] = Rows.concat([p[2] for p in pieces])
        sizes[index] = size
    return whole


def _longest(parts: List[Contents], which: str):
    """The longest of the ranks' sequential iterations, if the others are its beginning."""
    if not parts:
        return None, False
    digests = [[_element_digest(e) for e in p.elements] for p in parts]
    longest = max(range(len(parts)), key=lambda r: (len(digests[r]), parts[r].complete))
    for rank, found in enumerate(digests):
        if found != digests[longest][:len(found)] or (
                parts[rank].complete and len(found) != len(digests[longest])):
            step = next((j for j, (a, b) in enumerate(zip(found, digests[longest])) if a != b),
                        min(len(found), len(digests[longest])))
            raise ValueError(f"ranks {longest} and {rank} hold different values for element "
                             f"{step} of the {which} cache()")
    return parts[longest].elements, parts[longest].complete
