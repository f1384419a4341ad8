"""Layer 5: checkpoints in HDF5 (object graph, layout math, writer/reader, manager).

Also Orbax's names, so that ``import mpistrat.checkpoint as ocp`` stands in for
``import orbax.checkpoint as ocp``: ``ocp.CheckpointManager(directory, options=
ocp.CheckpointManagerOptions(...))``, ``ocp.args.StandardSave``/``StandardRestore``.
"""

from mpistrat.checkpoint.checkpoint import (Checkpoint, CheckpointLoadStatus, CheckpointOptions,
                                            latest_checkpoint)
from mpistrat.checkpoint.manager import CheckpointManager
from mpistrat.checkpoint import args
from mpistrat.checkpoint.orbax_manager import (CheckpointManagerOptions, OrbaxCheckpointManager,
                                               StepAlreadyExistsError)
from mpistrat.checkpoint.args import OrbaxNotSupportedError

__all__ = ["Checkpoint", "CheckpointLoadStatus", "CheckpointOptions", "CheckpointManager",
           "latest_checkpoint", "args", "CheckpointManagerOptions", "OrbaxCheckpointManager",
           "StepAlreadyExistsError", "OrbaxNotSupportedError"]
