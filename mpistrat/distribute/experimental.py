"""``ms.distribute.experimental``: TensorFlow's ``tf.distribute.experimental`` names.

``PreemptionCheckpointHandler`` and ``TerminationConfig`` live in ``mpistrat.preemption``
(they use checkpoints, a higher layer) and are added here when ``mpistrat`` is imported.

    >>> import mpistrat as ms
    >>> ms.distribute.experimental.MultiWorkerMirroredStrategy is ms.MultiWorkerMirroredStrategy
    True
"""

from mpistrat.collectives import CommunicationImplementation, CommunicationOptions
from mpistrat.distribute.mirrored import MultiWorkerMirroredStrategy
from mpistrat.distribute.tpu import TPUStrategy

__all__ = ["MultiWorkerMirroredStrategy", "TPUStrategy", "CommunicationOptions",
           "CommunicationImplementation", "PreemptionCheckpointHandler", "TerminationConfig"]
