"""``ms.train``: the checkpoint names as TensorFlow keeps them under ``tf.train``.

    >>> import mpistrat as ms
    >>> ms.train.Checkpoint is ms.Checkpoint
    True
    >>> ms.train.ClusterSpec({"worker": ["host0:2222", "host1:2222"]}).num_tasks("worker")
    2
"""

from mpistrat.checkpoint import (Checkpoint, CheckpointManager, CheckpointOptions,
                                 latest_checkpoint)
from mpistrat.checkpoint.tf_checkpoints import list_variables, load_checkpoint
from mpistrat.cluster_spec import ClusterSpec

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointOptions", "latest_checkpoint",
           "load_checkpoint", "list_variables", "ClusterSpec"]
