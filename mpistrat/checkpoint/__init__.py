"""Layer 5: checkpoints in HDF5 (object graph, layout math, writer/reader, manager)."""

from mpistrat.checkpoint.checkpoint import (Checkpoint, CheckpointLoadStatus, CheckpointOptions,
                                            latest_checkpoint)
from mpistrat.checkpoint.manager import CheckpointManager

__all__ = ["Checkpoint", "CheckpointLoadStatus", "CheckpointOptions", "CheckpointManager",
           "latest_checkpoint"]
