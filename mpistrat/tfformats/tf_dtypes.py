"""TensorFlow's ``DataType`` numbers and the NumPy dtypes they are read as (pure).

Numbers and ``bool`` are NumPy's own, ``bfloat16`` and the float8 types come from
``ml_dtypes``, strings are ``object`` arrays of ``bytes``; the dtypes in ``REFUSED``
(quantized, ``resource``, ``variant``, 4- and 2-bit) are known but not held::

    >>> numpy_dtype(1, "a test"), dtype_enum("int64"), REFUSED[21]
    (dtype('float32'), 9, 'variant')
"""

import numpy as np

from mpistrat.errors import DataLossError, InvalidArgumentError

__all__ = ["STRING", "REFUSED", "numpy_dtype", "dtype_enum"]

STRING = 7
_NUMERIC = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8",
            8: "complex64", 9: "int64", 10: "bool", 17: "uint16", 18: "complex128",
            19: "float16", 22: "uint32", 23: "uint64"}
_ML_DTYPES = {14: "bfloat16", 24: "float8_e5m2", 25: "float8_e4m3fn", 26: "float8_e4m3fnuz",
              27: "float8_e4m3b11fnuz", 28: "float8_e5m2fnuz"}
REFUSED = {11: "qint8", 12: "quint8", 13: "qint32", 15: "qint16", 16: "quint16",
           20: "resource", 21: "variant", 29: "int4", 30: "uint4", 31: "int2", 32: "uint2",
           33: "float4_e2m1fn"}


def numpy_dtype(enum: int, where: str) -> np.dtype:
    """The NumPy dtype of TensorFlow's ``DataType`` ``enum`` (``object`` for strings)."""
    if enum == STRING:
        return np.dtype(object)
    if enum in _NUMERIC:
        return np.dtype(_NUMERIC[enum])
    if enum in _ML_DTYPES:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, _ML_DTYPES[enum]))
    if enum in REFUSED:
        raise InvalidArgumentError(f"{where}: TensorFlow dtype {REFUSED[enum]} is not "
                                   f"supported (numbers, bool, bfloat16, float8 and strings are)")
    raise DataLossError(f"{where}: unknown TensorFlow dtype {enum}: the file is corrupt")


def dtype_enum(dtype: np.dtype) -> int:
    """TensorFlow's ``DataType`` for a NumPy dtype (``object``/bytes: ``DT_STRING``)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OS":
        return STRING
    for table in (_NUMERIC, _ML_DTYPES):
        for enum, name in table.items():
            if dtype.name == name:
                return enum
    raise InvalidArgumentError(f"dtype {dtype} has no TensorFlow checkpoint equivalent")
