"""``ms.data.experimental``: ``Optional`` (TensorFlow's ``tf.experimental.Optional``).

``DistributedIterator.get_next_as_optional()`` returns one: every rank learns
the end of data at the same step without an exception::

    >>> from mpistrat.data.experimental import Optional
    >>> Optional.from_value(3).get_value(), Optional.empty(None).has_value()
    (3, False)
"""

from typing import Any

from mpistrat.errors import InvalidArgumentError

__all__ = ["Optional"]

_ABSENT = object()


class Optional:
    """A value that may be absent: ``has_value()``, ``get_value()``, ``element_spec``."""

    def __init__(self, value: Any = _ABSENT, element_spec: Any = None):
        self._value, self._spec = value, element_spec

    @staticmethod
    def from_value(value: Any) -> "Optional":
        return Optional(value)

    @staticmethod
    def empty(element_spec: Any) -> "Optional":
        return Optional(_ABSENT, element_spec)

    def has_value(self) -> bool:
        return self._value is not _ABSENT

    def get_value(self) -> Any:
        if self._value is _ABSENT:
            raise InvalidArgumentError("get_value() of an empty Optional (the iterator had "
                                       "reached the end of its data)")
        return self._value

    @property
    def element_spec(self) -> Any:
        return self._spec

    def __repr__(self) -> str:
        return f"Optional({'empty' if self._value is _ABSENT else repr(self._value)})"
