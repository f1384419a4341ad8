"""What the HDF5 writer and reader of our checkpoints share (``h5write.py`` writes with
them, ``h5read.py`` checks with them; neither imports the other): the format version
written and those read, and the checksum of a partition.

    >>> import numpy as np
    >>> checksum(np.arange(3, dtype=np.int8))
    139757951
"""

import zlib

import numpy as np

__all__ = ["FORMAT_VERSION", "READ_VERSIONS", "checksum"]

FORMAT_VERSION = 2          # written in every file's mpistrat_format_version attribute
READ_VERSIONS = (1, 2)      # the versions this version reads


def checksum(block: np.ndarray) -> int:
    """CRC-32 of a block's bytes in C order."""
    return zlib.crc32(np.ascontiguousarray(block).view(np.uint8).reshape(-1)) & 0xFFFFFFFF
