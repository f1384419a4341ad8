"""Error classes of ``ms.errors``, named as in ``tf.errors``.

Each class is also a subclass of the matching builtin exception, so code
that catches ``FileNotFoundError`` or ``ValueError`` keeps working::

    >>> import mpistrat as ms
    >>> try:
    ...     raise ms.errors.NotFoundError("no checkpoint at /tmp/ckpt-3")
    ... except FileNotFoundError as err:
    ...     print(type(err).__name__)
    NotFoundError
"""

__all__ = [
    "OpError",
    "NotFoundError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "UnavailableError",
    "DataLossError",
    "AbortedError",
    "OutOfRangeError",
    "FailedPreconditionError",
]


class OpError(Exception):
    """Base of the mpistrat errors; ``message`` holds the text."""

    @property
    def message(self) -> str:
        return str(self)


class NotFoundError(OpError, FileNotFoundError):
    """A file, checkpoint or object path does not exist."""


class InvalidArgumentError(OpError, ValueError):
    """An argument is invalid: a shape, dtype or value ranks disagree on."""


class DeadlineExceededError(OpError, TimeoutError):
    """A collective did not complete within ``timeout_seconds``."""


class UnavailableError(OpError, ConnectionError):
    """A peer rank or a service is unavailable."""


class DataLossError(OpError, IOError):
    """Stored data is corrupt: a checksum failed or a file is truncated."""


class AbortedError(OpError, RuntimeError):
    """An operation was aborted, e.g. after an earlier collective timed out."""


class OutOfRangeError(OpError, IndexError):
    """An iterator is past its end: ``DistributedIterator.get_next()`` after the last step
    (``next()`` raises ``StopIteration`` there, as in tf.data)."""



class FailedPreconditionError(OpError, RuntimeError):
    """The system is not in a state the operation needs (as ``tf.errors``), e.g. JAX's CPU
    backend started with one thread before a host-callback collective could be made safe."""
