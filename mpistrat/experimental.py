"""``ms.experimental``: the aliases TensorFlow keeps under ``tf.distribute.experimental``.

    >>> import mpistrat as ms
    >>> ms.experimental.MultiWorkerMirroredStrategy is ms.MultiWorkerMirroredStrategy
    True
"""

from mpistrat.collectives import CommunicationImplementation, CommunicationOptions
from mpistrat.distribute import MultiWorkerMirroredStrategy, ValueContext

__all__ = ["MultiWorkerMirroredStrategy", "CommunicationOptions", "CommunicationImplementation",
           "ValueContext"]
