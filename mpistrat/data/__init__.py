"""Datasets (``ms.data``), below the strategies: their distribution over the replicas is
``distribute/input_lib.py`` (``strategy.experimental_distribute_dataset``), as TensorFlow's
``input_lib`` sits in ``tf.distribute``."""

from mpistrat.data import experimental
from mpistrat.data.dataset import (AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset,
                                   TensorSpec)
from mpistrat.data.options import AutoShardPolicy, Options
from mpistrat.data.readers import FixedLengthRecordDataset, HDF5Dataset, NpyDataset
from mpistrat.data.tfrecord import TFRecordDataset

__all__ = ["FixedLengthRecordDataset", "TFRecordDataset", "HDF5Dataset", "NpyDataset", "Dataset",
           "TensorSpec", "AutoShardPolicy", "Options", "AUTOTUNE",
           "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "experimental"]


def __getattr__(name: str):
    if name in ("DistributedDataset", "DistributedIterator"):
        raise AttributeError(f"mpistrat.data.{name} is ms.distribute.{name} (as TensorFlow's "
                             f"tf.distribute.{name}): distribution sits with the strategies")
    raise AttributeError(f"module 'mpistrat.data' has no attribute {name!r}")
