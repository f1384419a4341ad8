"""Layer 4: datasets and their distribution over the replicas (``ms.data``)."""

from mpistrat.data import experimental
from mpistrat.data.dataset import (AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset,
                                   TensorSpec)
from mpistrat.data.distributed import DistributedDataset
from mpistrat.data.options import AutoShardPolicy, Options
from mpistrat.data.readers import FixedLengthRecordDataset, HDF5Dataset, NpyDataset
from mpistrat.data.tfrecord import TFRecordDataset

__all__ = ["FixedLengthRecordDataset", "TFRecordDataset", "HDF5Dataset", "NpyDataset", "Dataset",
           "TensorSpec", "DistributedDataset", "AutoShardPolicy", "Options", "AUTOTUNE",
           "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "experimental"]
