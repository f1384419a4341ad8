"""``ms.tpu``: the TPU system calls of ``tf.tpu``, over the JAX bridge.

    >>> import mpistrat as ms
    >>> callable(ms.tpu.experimental.initialize_tpu_system)
    True
"""

from mpistrat.tpu import experimental

__all__ = ["experimental"]
