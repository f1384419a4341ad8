"""Layer 4: datasets and their distribution over the replicas (``ms.data``)."""

from mpistrat.data.dataset import Dataset, TensorSpec
from mpistrat.data.distributed import DistributedDataset
from mpistrat.data.options import AutoShardPolicy, Options

__all__ = ["Dataset", "TensorSpec", "DistributedDataset", "AutoShardPolicy", "Options"]
