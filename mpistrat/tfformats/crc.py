"""CRC-32C (Castagnoli) and TensorFlow's masked form of it.

TensorFlow checks its files with CRC-32C: TFRecord framing, tensor bundle
entries and LevelDB table blocks store ``mask(crc)``, a rotation plus a
constant, so that a CRC of data which itself holds CRCs does not cancel out.
``google-crc32c`` computes the CRC (hardware instructions) when installed; a
table-driven pure-Python fallback is used where it is missing (about 1000
times slower: docs/benchmarks.md)::

    >>> from mpistrat.tfformats.crc import crc32c, masked_crc32c, unmask
    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    >>> unmask(masked_crc32c(b"abc")) == crc32c(b"abc")
    True
"""

import functools
from typing import Callable

import numpy as np

__all__ = ["crc32c", "extend", "mask", "unmask", "masked_crc32c", "crc_function",
           "crc_table", "implementation"]

_MASK_DELTA = 0xA282EAD8
_POLY = 0x82F63B78  # CRC-32C, reflected


@functools.lru_cache(maxsize=None)
def crc_table() -> tuple:
    """The 256-entry table of the reflected CRC-32C, for table-driven computations."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (_POLY if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


def _python_extend(crc: int, data) -> int:
    table = crc_table()
    crc ^= 0xFFFFFFFF
    for byte in memoryview(data).cast("B"):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _choose() -> Callable[[int, bytes], int]:
    try:
        import google_crc32c
    except ImportError:
        return _python_extend
    if google_crc32c.implementation != "c":  # its own pure-Python path is no faster than ours
        return _python_extend
    return google_crc32c.extend


_EXTEND = None


def _bytes_view(data):
    """``data`` as something both implementations take without a copy: bytes as they are,
    anything else with the buffer protocol (memoryview, bytearray, NumPy) as uint8 NumPy."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def extend(crc: int, data) -> int:
    """The CRC-32C of the bytes before (whose CRC is ``crc``) followed by ``data``."""
    global _EXTEND
    if _EXTEND is None:
        _EXTEND = _choose()
    return _EXTEND(crc, _bytes_view(data))


def crc32c(data) -> int:
    """The CRC-32C of ``data`` (bytes, or any contiguous buffer: memoryview, NumPy)."""
    return extend(0, data)


def mask(crc: int) -> int:
    """TensorFlow's masked CRC: rotate right by 15 bits, add a constant (mod 2**32)."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """The CRC that ``mask`` turned into ``masked``."""
    rotated = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


def masked_crc32c(data) -> int:
    """``mask(crc32c(data))``, as stored in TensorFlow's files."""
    return mask(extend(0, data))


def crc_function() -> Callable[[bytes], int]:
    """The fastest ``crc32c(data)`` for ``bytes`` (no conversion: for tight loops)."""
    extend(0, b"")
    if _EXTEND is _python_extend:
        return lambda data: _python_extend(0, data)
    import google_crc32c
    return google_crc32c.value


def implementation() -> str:
    """``"google-crc32c"`` or ``"python"``: which computes the CRCs in this process."""
    extend(0, b"")
    return "python" if _EXTEND is _python_extend else "google-crc32c"
