"""Horovod's compression: what a tensor travels as (``Compression.none``, the default, or
``Compression.fp16``: floating tensors as float16, the result cast back to the input's
dtype); any class with ``compress``/``decompress`` works too::

    wire, ctx = hvd.Compression.fp16.compress(np.ones(3, np.float32))   # float16 on the wire
    back = hvd.Compression.fp16.decompress(wire, ctx)                    # float32 again
"""

from typing import Any

import numpy as np


def _floating(dtype: np.dtype) -> bool:
    """Floating in TensorFlow's sense (what Horovod's fp16 compression casts)."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


class Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)`` before the
    reduction, ``decompress(tensor, ctx) -> tensor`` after it (NumPy arrays here)."""

    @staticmethod
    def compress(tensor: Any):
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is (Horovod's default)."""


class FP16Compressor(Compressor):
    """Floating tensors travel as float16; the result is cast back to the input's dtype
    (other tensors travel as they are)."""

    @staticmethod
    def compress(tensor: Any):
        value = np.asarray(tensor)
        return (value.astype(np.float16) if _floating(value.dtype) else value), value.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        value = np.asarray(tensor)
        return value.astype(ctx) if _floating(np.dtype(ctx)) else value


class Compression:
    """Horovod's compression choices: ``Compression.none`` (the default) and
    ``Compression.fp16``; a class of its own with ``compress``/``decompress`` works too."""
    none = NoneCompressor
    fp16 = FP16Compressor


def _compression_name(compression: Any) -> str:
    for name in ("none", "fp16"):
        if compression is getattr(Compression, name):
            return f"Compression.{name}"
    return getattr(compression, "__name__", None) or repr(compression)
