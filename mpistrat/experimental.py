"""``ms.experimental``: the aliases TensorFlow keeps under ``tf.distribute.experimental``.

    >>> import mpistrat as ms
    >>> ms.experimental.MultiWorkerMirroredStrategy is ms.MultiWorkerMirroredStrategy
    True
"""

from mpistrat.collectives import CommunicationImplementation, CommunicationOptions
from mpistrat.distribute import MultiWorkerMirroredStrategy, ValueContext
from mpistrat.distribute.tpu import TPUStrategy

__all__ = ["MultiWorkerMirroredStrategy", "TPUStrategy", "CommunicationOptions", "CommunicationImplementation",
           "ValueContext"]
