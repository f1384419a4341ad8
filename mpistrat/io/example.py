"""``tf.train.Example`` parsing as ``tf.io.parse_single_example`` / ``parse_example``, to NumPy.

Features are ``FixedLenFeature(shape, dtype, default_value=None)`` and
``VarLenFeature(dtype)``, with dtype ``float32``, ``int64`` or ``string`` (as a string, a
NumPy type, ``bytes``, or a TensorFlow dtype). Results are NumPy arrays (strings: object
arrays of ``bytes``); a ``VarLenFeature`` gives a :class:`SparseTensorValue` with
``indices`` (int64, one row per value: its position, or example and position for a batch),
``values`` and ``dense_shape``, as TensorFlow's ``SparseTensor`` holds them::

    >>> import mpistrat as ms
    >>> data = ms.io.serialize_example({"x": [1.0, 2.0], "tags": [7, 8, 9], "id": [b"a"]})
    >>> parsed = ms.io.parse_single_example(data, {
    ...     "x": ms.io.FixedLenFeature([2], "float32"),
    ...     "id": ms.io.FixedLenFeature([], "string"),
    ...     "tags": ms.io.VarLenFeature("int64"),
    ...     "w": ms.io.FixedLenFeature([], "float32", default_value=0.5)})
    >>> parsed["x"].tolist(), parsed["id"][()], parsed["tags"].values.tolist(), float(parsed["w"])
    ([1.0, 2.0], b'a', [7, 8, 9], 0.5)
    >>> batch = ms.io.parse_example([data, data], {"tags": ms.io.VarLenFeature("int64")})
    >>> batch["tags"].dense_shape.tolist(), batch["tags"].indices[:2].tolist()
    ([2, 3], [[0, 0], [0, 1]])

A batch is taken apart at once with NumPy (``example_batch.py``: each level of the message
one vectorised step over all records); a batch in an unusual encoding, or one that must
raise an error, is parsed record by record by TensorFlow's own rules (``fast_parsing.py``,
which ``parse_single_example`` uses for its record), not protobuf's: every byte string gets
TensorFlow's values or its error. Malformed data, a missing required feature, a wrong type
or count raise ``InvalidArgumentError`` naming the feature, as TensorFlow does.
"""

import math
from typing import Any, Dict, List, NamedTuple, Sequence

import numpy as np

from mpistrat.errors import InvalidArgumentError
from mpistrat.io.example_batch import parse_batch
from mpistrat.io.fast_parsing import join_pieces, parse_record
from mpistrat.io.sparse import SparseTensorValue, ragged_positions
from mpistrat.tfformats import messages

__all__ = ["FixedLenFeature", "VarLenFeature", "FixedLenSequenceFeature", "SparseTensorValue",
           "parse_single_example", "parse_example", "serialize_example"]

_KINDS = {"float32": "float_list", "int64": "int64_list", "string": "bytes_list"}
_NUMPY = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64),
          "string": np.dtype(object)}
_TF_NAMES = {"float32": "float", "int64": "int64", "string": "string"}


def _dtype_name(dtype) -> str:
    """``float32``, ``int64`` or ``string`` from any of their spellings."""
    name = getattr(dtype, "name", None)          # TensorFlow's and NumPy's dtypes
    if not isinstance(name, str):
        if dtype in (bytes, str, object, np.bytes_, np.str_, np.object_):
            name = "string"
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = str(dtype)
    name = {"float": "float32", "bytes": "string", "object": "string", "str": "string",
            "bytes_": "string"}.get(name, name)
    if name not in _KINDS:
        raise InvalidArgumentError(f"feature dtype {dtype!r}: tf.train.Example holds float32, "
                                   f"int64 or string")
    return name


class FixedLenFeature(NamedTuple):
    """A feature of fixed ``shape``; ``default_value`` fills in when it is missing."""

    shape: Sequence[int]
    dtype: Any
    default_value: Any = None


class VarLenFeature(NamedTuple):
    """A feature of any length: parsed into a :class:`SparseTensorValue`."""

    dtype: Any


class FixedLenSequenceFeature(NamedTuple):
    """A list of any number of items of ``shape``: parsed into a dense array ``[items] +
    shape`` (``[batch, longest] + shape`` for a batch, padded with ``default_value`` or
    zeros). In ``parse_example`` ``allow_missing`` must be true (a missing feature has no
    items), as in TensorFlow; in a SequenceExample's feature lists it says whether a missing
    list is an error."""

    shape: Sequence[int]
    dtype: Any
    allow_missing: bool = False
    default_value: Any = None


class _Spec:
    """A feature, checked once: its dtype name, list kind, shape and default."""

    def __init__(self, name: str, feature):
        if not isinstance(feature, (FixedLenFeature, VarLenFeature, FixedLenSequenceFeature)):
            raise InvalidArgumentError(f"feature {name!r}: expected FixedLenFeature, "
                                       f"VarLenFeature or FixedLenSequenceFeature, got "
                                       f"{type(feature).__name__}")
        self.name, self.dtype = name, _dtype_name(feature.dtype)
        self.key = name.encode("utf-8")
        self.kind, self.numpy = _KINDS[self.dtype], _NUMPY[self.dtype]
        self.fixed = isinstance(feature, FixedLenFeature)
        self.sequence = isinstance(feature, FixedLenSequenceFeature)  # parsed as VarLen, then
        self.shape: tuple = ()                                         # made dense
        self.default = None
        if self.sequence:
            self.shape = tuple(int(d) for d in feature.shape)
            self.allow_missing = bool(feature.allow_missing)
            self.pad = np.zeros((), self.numpy) if self.dtype != "string" else b""
            if feature.default_value is not None:
                if np.size(feature.default_value) != 1:
                    raise InvalidArgumentError(
                        f"feature {name!r}: a FixedLenSequenceFeature's default_value pads "
                        f"with one value: give a scalar, not {feature.default_value!r}")
                self.pad = self._default(feature.default_value)[0]
        if self.fixed:
            self.shape = tuple(int(d) for d in feature.shape)
            if any(d < 0 for d in self.shape):
                raise InvalidArgumentError(f"feature {name!r}: shape {list(self.shape)} must "
                                           f"be fully defined")
            if feature.default_value is not None:
                default = self._default(feature.default_value)
                if default.size:              # (TensorFlow: no values is no default)
                    self.default = self._piece(default)
        self.size = math.prod(self.shape)

    def _default(self, value) -> np.ndarray:
        """``default_value`` as the feature's values, flat: strings as UTF-8 bytes (as
        TensorFlow gives them), exactly the shape's count of values (TensorFlow reshapes
        it to the shape: one value for a shape of more is its InvalidArgumentError too;
        a FixedLenSequenceFeature's is one value), else an error naming the feature (here,
        when the features are given, not mid-epoch)."""
        if self.dtype == "string":
            value = np.asarray(value, dtype=object)
            flat = [v.encode("utf-8") if isinstance(v, str) else v for v in value.reshape(-1)]
            if not all(isinstance(v, (bytes, np.bytes_)) for v in flat):
                raise InvalidArgumentError(
                    f"feature {self.name!r}: default_value {value.tolist()!r} is not strings "
                    f"or bytes")
            default = np.empty(len(flat), dtype=object)
            default[:] = [bytes(v) for v in flat]
            default = default.reshape(value.shape)
        else:
            try:
                default = np.asarray(value, dtype=self.numpy)
            except (TypeError, ValueError) as err:
                raise InvalidArgumentError(f"feature {self.name!r}: default_value {value!r} "
                                           f"is not {self.dtype}: {err}") from None
        size = math.prod(self.shape)
        if default.size == size or (self.sequence and default.size == 1):
            return default.reshape(-1)
        raise InvalidArgumentError(
            f"feature {self.name!r}: default_value of shape {list(default.shape)} "
            f"({default.size} values) does not fit the feature's shape {list(self.shape)} "
            f"({size} values): give {size} (TensorFlow reshapes it, it does not broadcast)")

    def _piece(self, values: np.ndarray):
        """Values as gathered: float32 as little-endian bytes (joined into one array at
        the end), int64 and strings as lists."""
        if self.dtype == "float32":
            return values.astype("<f4").tobytes()
        return values.astype(np.int64).tolist() if self.dtype == "int64" else list(values)

    def empty(self):
        """No values, as gathered."""
        return self._piece(np.zeros(0, self.numpy))

    def missing(self, index: int):
        """The values of a feature record ``index`` lacks: a FixedLenFeature's default
        (an error without one), else none."""
        if not self.fixed:
            return self.empty()
        if self.default is None:
            raise InvalidArgumentError(
                f"Feature: {self.name} (data type: {_TF_NAMES[self.dtype]}) is required "
                f"but could not be found (example {index})")
        return self.default


_CHECKED: Dict[tuple, List[_Spec]] = {}   # features checked before (a map's every batch)


def _specs(features: Dict[str, Any]) -> List[_Spec]:
    if not isinstance(features, dict) or not features:
        raise InvalidArgumentError("features must be a non-empty dict of name -> "
                                   "FixedLenFeature or VarLenFeature")
    key = _key_of(features)
    known = _CHECKED.get(key) if key is not None else None
    if known is None:
        known = [_Spec(str(name), feature) for name, feature in sorted(features.items())]
        if key is not None and len(_CHECKED) < 256:
            _CHECKED[key] = known
    return known


def _key_of(features: Dict[str, Any]):
    """The features as a key of ``_CHECKED``, or ``None`` (checked anew each time): kept only
    where every feature has no ``default_value`` (a default's bits, -0.0 or 0.0, would hash
    alike) and a list or tuple for a shape (a generator is read once); names as their ``str``,
    as the specs name them (``1`` and ``True`` hash alike)."""
    key = []
    try:
        for name, f in sorted(features.items()):
            shape = getattr(f, "shape", ())
            if getattr(f, "default_value", None) is not None or \
                    not isinstance(shape, (list, tuple)):
                return None
            key.append((str(name), type(f), getattr(f, "dtype", None), tuple(shape),
                        getattr(f, "allow_missing", None)))
        key = tuple(key)
        hash(key)
    except TypeError:      # (a name or dtype that cannot be sorted or hashed)
        return None
    return key


def _array(pieces: List, spec: _Spec) -> np.ndarray:
    """One array of every example's values (pieces as ``_Spec._piece`` makes them)."""
    return join_pieces(pieces, spec.dtype)


def _count(piece, spec: _Spec) -> int:
    return len(piece) // 4 if spec.dtype == "float32" else len(piece)


def _gather(examples, specs: List[_Spec], single: bool) -> List[list]:
    """Per feature, the checked values of every example, by TensorFlow's rules for a batch's
    records or (``single``) for ``parse_single_example``'s record."""
    by_key = {spec.key: d for d, spec in enumerate(specs)}
    columns: List[list] = [[] for _ in specs]
    for index, data in enumerate(examples):
        for column, piece in zip(columns, parse_record(data, specs, by_key, index, single)):
            column.append(piece)
    return columns


def parse_example(serialized, features: Dict[str, Any], example_names=None,
                  name=None) -> Dict[str, Any]:
    """Parse a batch of serialized examples (a list, or a 1-D object array of ``bytes``).

    FixedLen features give arrays ``[batch] + shape``; VarLen features a
    :class:`SparseTensorValue` with ``indices`` ``[n, 2]`` (example, position) and
    ``dense_shape`` ``[batch, longest]``.
    """
    examples = list(np.asarray(serialized, dtype=object).reshape(-1)) \
        if not isinstance(serialized, (list, tuple)) else list(serialized)
    specs = _specs(features)
    _check_sequences(specs)
    for spec in specs:
        if spec.sequence and not spec.size:
            raise InvalidArgumentError(f"feature {spec.name!r}: a FixedLenSequenceFeature of "
                                       f"items of 0 values (TensorFlow crashes on it)")
    fast = parse_batch(examples, specs)       # all records at once (canonical encodings)
    out = fast if fast is not None else parse_each(examples, specs)
    for spec in specs:
        if spec.sequence:
            out[spec.name] = dense_items(out[spec.name], spec, len(examples))
    return out


def _check_sequences(specs: List[_Spec]) -> None:
    for spec in specs:
        if spec.sequence and not spec.allow_missing:
            raise ValueError(f"feature {spec.name!r}: Unsupported: FixedLenSequenceFeature "
                             f"requires allow_missing to be True.")


def dense_items(sparse: "SparseTensorValue", spec: _Spec, count: int) -> np.ndarray:
    """A ``FixedLenSequenceFeature``'s values (parsed as a VarLen feature, rows ``[b, j]``)
    as ``[count, longest] + shape``, padded; each row's values must fill whole items."""
    size = max(math.prod(spec.shape), 1)
    lengths = np.bincount(sparse.indices[:, 0], minlength=count) if len(sparse.values) \
        else np.zeros(count, np.int64)
    bad = np.flatnonzero(lengths % size)
    if len(bad):
        raise InvalidArgumentError(
            f"Key: {spec.name}, Index: {int(bad[0])}.  Number of {_TF_NAMES[spec.dtype]} "
            f"values is not a multiple of stride length. Saw {int(lengths[bad[0]])} values "
            f"but output shape is: [?,{','.join(map(str, spec.shape))}]")
    longest = int(lengths.max()) // size if count else 0
    out = np.empty((count, longest * size), dtype=spec.numpy)
    out[...] = spec.pad
    out[sparse.indices[:, 0], sparse.indices[:, 1]] = sparse.values
    return out.reshape((count, longest) + spec.shape)


def parse_each(examples: List, specs: List[_Spec]) -> Dict[str, Any]:
    """``parse_example`` record by record by TensorFlow's rules (``fast_parsing.py``):
    every encoding, every error worded (what ``example_batch.parse_batch`` leaves to it)."""
    columns = _gather(examples, specs, single=False)
    out: Dict[str, Any] = {}
    for spec, lists in zip(specs, columns):
        if spec.fixed:
            out[spec.name] = _array(lists, spec).reshape((len(examples),) + spec.shape)
            continue
        lengths = np.array([_count(v, spec) for v in lists], dtype=np.int64)
        rows, positions = ragged_positions(lengths)
        values = _array(lists, spec)
        out[spec.name] = SparseTensorValue(
            np.stack([rows, positions], axis=1).reshape(-1, 2), values,
            np.array([len(lists), int(lengths.max()) if len(lists) else 0], dtype=np.int64))
    return out


def parse_single_example(serialized, features: Dict[str, Any], example_names=None,
                         name=None) -> Dict[str, Any]:
    """Parse one serialized example: FixedLen features as arrays of their ``shape``,
    VarLen features as a :class:`SparseTensorValue` with ``indices`` ``[n, 1]``."""
    if isinstance(serialized, np.ndarray) and serialized.shape == ():
        serialized = serialized[()]
    specs = _specs(features)
    _check_sequences(specs)
    columns = _gather([serialized], specs, single=True)
    out: Dict[str, Any] = {}
    for spec, pieces in zip(specs, columns):
        values = _array(pieces, spec)
        if spec.sequence:
            sparse = SparseTensorValue(np.stack([np.zeros(len(values), np.int64),
                                                 np.arange(len(values))], axis=1), values, None)
            out[spec.name] = dense_items(sparse, spec, 1)[0]
        elif spec.fixed:
            out[spec.name] = values.reshape(spec.shape)
        else:
            out[spec.name] = SparseTensorValue(
                np.arange(len(values), dtype=np.int64).reshape(-1, 1), values,
                np.array([len(values)], dtype=np.int64))
    return out


def serialize_example(features: Dict[str, Any]) -> bytes:
    """A serialized ``tf.train.Example`` of ``name -> values`` (floats become a float list,
    integers an int64 list, bytes and strings a bytes list; bytes keep their trailing zero
    bytes, which NumPy's ``S`` arrays drop)::

        >>> parse_single_example(serialize_example({"s": [b"ab\\x00"]}),
        ...                      {"s": VarLenFeature("string")})["s"].values.tolist()
        [b'ab\\x00']
    """
    feature = {}
    for key, values in sorted(features.items()):
        array = np.asarray(values)
        if array.dtype.kind == "S" and not isinstance(values, np.ndarray):
            array = np.asarray(values, dtype=object)      # the bytes as given
        if array.dtype.kind in "SUO":
            items = [v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
            feature[str(key)] = {"bytes_list": {"value": items}}
        elif array.dtype.kind in "iub":
            feature[str(key)] = {"int64_list": {"value": [int(v) for v in array.reshape(-1)]}}
        elif array.dtype.kind == "f":
            feature[str(key)] = {"float_list": {"value": array.astype(np.float32).reshape(
                -1).tolist()}}
        else:
            raise InvalidArgumentError(f"feature {key!r}: values of dtype {array.dtype} do not "
                                       f"fit a tf.train.Example")
    return messages.serialize("Example", {"features": {"feature": feature}})
