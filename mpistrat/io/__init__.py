"""``ms.io``: TensorFlow's example parsing and record writing, without TensorFlow.

``parse_single_example``, ``parse_example``, ``FixedLenFeature``, ``VarLenFeature`` and
``SparseTensorValue`` (``example.py``); ``TFRecordWriter`` and ``TFRecordOptions``
(``records.py``); ``serialize_example`` (ours) writes a ``tf.train.Example``.
Read TFRecord files with ``ms.data.TFRecordDataset``.
"""

from mpistrat.io.example import (FixedLenFeature, SparseTensorValue, VarLenFeature,
                                 parse_example, parse_single_example, serialize_example)
from mpistrat.io.records import TFRecordOptions, TFRecordWriter

__all__ = ["FixedLenFeature", "VarLenFeature", "SparseTensorValue", "parse_example",
           "parse_single_example", "serialize_example", "TFRecordWriter", "TFRecordOptions"]
