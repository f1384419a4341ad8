"""``ms.train``: the checkpoint names as TensorFlow keeps them under ``tf.train``.

    >>> import mpistrat as ms
    >>> ms.train.Checkpoint is ms.Checkpoint
    True
"""

from mpistrat.checkpoint import (Checkpoint, CheckpointManager, CheckpointOptions,
                                 latest_checkpoint)
from mpistrat.checkpoint.tf_checkpoints import list_variables, load_checkpoint

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointOptions", "latest_checkpoint",
           "load_checkpoint", "list_variables"]
