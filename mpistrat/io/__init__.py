"""``ms.io``: TensorFlow's example parsing and record writing, without TensorFlow.

``parse_single_example``, ``parse_example``, ``FixedLenFeature``, ``VarLenFeature``,
``FixedLenSequenceFeature`` and ``SparseTensorValue`` (``example.py``);
``parse_single_sequence_example`` and ``parse_sequence_example`` (``sequence_example.py``); ``TFRecordWriter`` and ``TFRecordOptions``
(``records.py``); ``serialize_example`` (ours) writes a ``tf.train.Example``.
Read TFRecord files with ``ms.data.TFRecordDataset``.
"""

from mpistrat.io.example import (FixedLenFeature, FixedLenSequenceFeature, SparseTensorValue,
                                 VarLenFeature, parse_example, parse_single_example,
                                 serialize_example)
from mpistrat.io.records import TFRecordOptions, TFRecordWriter
from mpistrat.io.sequence_example import parse_sequence_example, parse_single_sequence_example

__all__ = ["FixedLenFeature", "VarLenFeature", "FixedLenSequenceFeature", "SparseTensorValue",
           "parse_example", "parse_single_example", "parse_sequence_example",
           "parse_single_sequence_example", "serialize_example", "TFRecordWriter",
           "TFRecordOptions"]
