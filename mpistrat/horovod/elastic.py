"""``hvd.elastic``: Horovod's elastic training, refused by name.

Horovod's elastic mode keeps a job running while workers join and leave: ``@hvd.elastic.run``
re-enters the training function after a change, and a ``State`` (``KerasState``,
``ObjectState``, ...) is committed in memory and synced to the new workers. mpistrat has no
in-job elasticity: the ranks of an MPI job are fixed from its start to its end. Its elastic
story is requeue and resume: ``slurm/train_elastic.sbatch`` asks Slurm for ``--nodes=MIN-MAX``;
on preemption every rank writes a checkpoint at the same step
(``ms.distribute.experimental.PreemptionCheckpointHandler``) and the job requeues itself; the
restart, at whatever width Slurm gives it, restores the model, the optimizer and the dataset
position and goes on (``docs/slurm.md``; ``docs/getting-started.md``, "Input at scale: random
access, positions, elastic jobs").

Every name below raises ``hvd.NotSupportedError`` (a ``NotImplementedError`` and a
``ValueError``) when used: ``run`` when it decorates, the classes when they are made.
"""

from typing import Any

from mpistrat.horovod.world import NotSupportedError

__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState",
           "TensorFlowState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]

_STORY = ("mpistrat has no in-job elasticity (the ranks of a job are fixed); for elastic "
          "training use slurm/train_elastic.sbatch: --nodes=MIN-MAX, a checkpoint at the same "
          "step on every rank when preempted (ms.distribute.experimental."
          "PreemptionCheckpointHandler), and a restart that resumes at whatever width it gets "
          "(docs/slurm.md, docs/getting-started.md); in the program, drop @hvd.elastic.run "
          "and the State and save checkpoints (ms.Checkpoint)")


def _refused(name: str) -> NotSupportedError:
    return NotSupportedError(f"hvd.elastic.{name} is not supported by mpistrat.horovod: "
                             f"{_STORY}")


def run(func: Any) -> Any:
    """Refused: ``@hvd.elastic.run`` raises ``NotSupportedError`` when it decorates."""
    raise _refused("run")


class _Refused:
    """A Horovod elastic class: making one (or one of a subclass) raises
    ``NotSupportedError``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise _refused(cls.__name__)


class State(_Refused):
    """Refused (Horovod's base of the elastic states)."""


class ObjectState(State):
    """Refused (Horovod's state of picklable attributes)."""


class TensorFlowState(ObjectState):
    """Refused (Horovod's state of TensorFlow variables)."""


class TensorFlowKerasState(ObjectState):
    """Refused (Horovod's state of a Keras model and optimizer)."""


class KerasState(TensorFlowKerasState):
    """Refused (``horovod.tensorflow.keras.elastic.KerasState``)."""


class CommitStateCallback(_Refused):
    """Refused (Horovod's callback that commits the state every few batches)."""


class UpdateBatchStateCallback(_Refused):
    """Refused (Horovod's callback that records the batch in the state)."""


class UpdateEpochStateCallback(_Refused):
    """Refused (Horovod's callback that records the epoch in the state)."""
