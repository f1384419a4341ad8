"""Which dtypes a checkpoint stores, and how: one rule for the writer and the reader. Pure.

Plain NumPy numbers and bools are stored as they are (little- or big-endian:
HDF5 records the byte order, so ``>f8`` comes back as ``>f8``). Types HDF5
does not know are stored as their raw bits, an unsigned integer of the same
width, with the attribute ``mpistrat_dtype`` naming the logical dtype, so
h5py shows honest numbers and our reader restores the exact type, bit for
bit:

- ``ml_dtypes`` types (``bfloat16``, the ``float8_*``, ``float6_*`` and
  ``float4_*`` formats, ``int4``, ``uint4``, ``int2``, ``uint2``): ``uint8``
  or ``uint16`` bits;
- ``datetime64[unit]`` and ``timedelta64[unit]``: ``int64`` (their NumPy
  representation), named e.g. ``datetime64[ns]``.

Anything else (strings, objects, structured or void types) cannot be
restored and is refused at save with a ``TypeError`` naming the object path::

    >>> import numpy as np, ml_dtypes
    >>> from mpistrat.checkpoint.dtypes import to_stored, logical_dtype
    >>> stored, name = to_stored(np.ones(2, ml_dtypes.bfloat16), "model/w")
    >>> stored.dtype, name
    (dtype('uint16'), 'bfloat16')
    >>> logical_dtype(stored.dtype, name, "f.h5, 'model/w'")
    dtype(bfloat16)
    >>> to_stored(np.array(["a"]), "model/names")
    Traceback (most recent call last):
    ...
    TypeError: object 'model/names': dtype <U1 cannot be saved in a checkpoint (numbers, bools, ml_dtypes and datetime64/timedelta64 only)
"""

import re
from typing import Optional, Tuple

import numpy as np

from mpistrat.errors import DataLossError

__all__ = ["DTYPE_ATTR", "ARRAY_TYPE_ATTR", "TF_NAME_ATTR", "to_stored", "logical_dtype", "check_plain"]

DTYPE_ATTR = "mpistrat_dtype"
ARRAY_TYPE_ATTR = "mpistrat_array_type"   # "jax": saved from a JAX array (else absent)
TF_NAME_ATTR = "mpistrat_tf_full_name"    # a converted TensorFlow value's own name
_ML_DTYPES = ("bfloat16", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
              "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
              "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "int4", "uint4", "int2", "uint2")
_TIME = re.compile(r"^(datetime64|timedelta64)(\[(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?$")
_PLAIN = set("?bBhHiIlLqQefdgFDG")  # NumPy's own bool, integer, float and complex types


def _ml_dtype(name: str) -> Optional[np.dtype]:
    if name not in _ML_DTYPES:
        return None
    try:
        import ml_dtypes
    except ImportError:
        return None
    kind = getattr(ml_dtypes, name, None)
    return None if kind is None else np.dtype(kind)


def check_plain(dtype: np.dtype) -> bool:
    """Whether HDF5 stores ``dtype`` as it is: a NumPy bool, integer, float or complex."""
    return dtype.char in _PLAIN and dtype.fields is None and dtype.subdtype is None \
        and type(dtype) is type(np.dtype(dtype.char))


def _logical_name(dtype: np.dtype) -> Optional[str]:
    """The ``mpistrat_dtype`` name of a type stored as raw bits, or ``None``."""
    if dtype.kind in "Mm":
        name = np.dtype(dtype).newbyteorder("=").name
        return name if _TIME.match(name) and dtype.itemsize == 8 else None
    ml = _ml_dtype(dtype.name)
    return dtype.name if ml is not None and ml == dtype else None


def to_stored(value: np.ndarray, path: str) -> Tuple[np.ndarray, Optional[str]]:
    """``value`` as it is written (a view where it is contiguous) and its ``mpistrat_dtype`` name.

    ``TypeError`` naming ``path`` for a dtype that could not be restored.
    """
    dtype = value.dtype
    if check_plain(dtype):
        return value, None
    name = _logical_name(dtype)
    if name is None:
        raise TypeError(f"object {path!r}: dtype {dtype.str if dtype.names is None else dtype} "
                        f"cannot be saved in a checkpoint (numbers, bools, ml_dtypes and "
                        f"datetime64/timedelta64 only)")
    bits = np.dtype("i8" if dtype.kind in "Mm" else f"u{dtype.itemsize}")
    if dtype.byteorder == ">":
        bits = bits.newbyteorder(">")
    contiguous = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d
    return contiguous.view(bits), name


def logical_dtype(stored: np.dtype, name, where: str) -> np.dtype:
    """The dtype a value stored as ``stored`` restores to (``name``: its ``mpistrat_dtype``
    attribute, or ``None``); ``DataLossError`` naming ``where`` if the pair is not ours."""
    if name is None:
        return stored
    if isinstance(name, bytes):
        name = name.decode("ascii", "replace")
    if not isinstance(name, str):
        raise DataLossError(f"{where}: attribute {DTYPE_ATTR} is not a string")
    if _TIME.match(name):
        logical = np.dtype(name)
        want = "i"
    else:
        logical = _ml_dtype(name)
        want = "u"
        if logical is None:
            raise DataLossError(f"{where}: {DTYPE_ATTR}={name!r} is not a dtype this version "
                                f"restores ({', '.join(_ML_DTYPES)}, datetime64, timedelta64)")
    if stored.kind != want or stored.itemsize != logical.itemsize:
        raise DataLossError(f"{where}: {DTYPE_ATTR}={name!r} is stored as {stored}, expected "
                            f"{'u' if want == 'u' else 'i'}nt{8 * logical.itemsize}")
    return logical.newbyteorder(stored.byteorder) if stored.byteorder == ">" else logical
