"""``ms.io.TFRecordWriter``: write TFRecord files (plain, GZIP or ZLIB) as TensorFlow does.

    >>> import os, tempfile, mpistrat as ms
    >>> path = os.path.join(tempfile.mkdtemp(), "a.tfrecord.gz")
    >>> with ms.io.TFRecordWriter(path, "GZIP") as writer:
    ...     writer.write(b"hello")
    >>> [bytes(r) for r in ms.data.TFRecordDataset(path, "GZIP")]
    [b'hello']
"""

import os
import zlib
from typing import Optional

from mpistrat.tfformats.records import compression_of, frame

__all__ = ["TFRecordWriter", "TFRecordOptions"]


class TFRecordOptions:
    """``compression_type`` (``None``/``""``, ``"GZIP"``, ``"ZLIB"``) and its level."""

    def __init__(self, compression_type: Optional[str] = None,
                 compression_level: Optional[int] = None):
        self.compression_type = compression_of(compression_type)
        self.compression_level = 6 if compression_level is None else int(compression_level)


class TFRecordWriter:
    """Appends framed records to a new file; ``close`` (or leaving ``with``) finishes it."""

    def __init__(self, path, options=None):
        if not isinstance(options, TFRecordOptions):
            options = TFRecordOptions(options)
        self._options = options
        self._file = open(os.fspath(path), "wb")
        self._deflate = None
        if options.compression_type is not None:
            wbits = 16 + zlib.MAX_WBITS if options.compression_type == "GZIP" else zlib.MAX_WBITS
            self._deflate = zlib.compressobj(options.compression_level, zlib.DEFLATED, wbits)

    def write(self, record: bytes) -> None:
        """Append one record."""
        data = frame(bytes(record))
        self._file.write(self._deflate.compress(data) if self._deflate else data)

    def flush(self) -> None:
        if self._deflate is not None:
            self._file.write(self._deflate.flush(zlib.Z_SYNC_FLUSH))
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        if self._deflate is not None:
            self._file.write(self._deflate.flush(zlib.Z_FINISH))
        self._file.close()

    def __enter__(self) -> "TFRecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
