"""What a restore matched: ``CheckpointLoadStatus`` and its ``assert_*`` methods, as
TensorFlow's; and the refusal of a restore that matched nothing.

    >>> status = CheckpointLoadStatus("ckpt-1", {"w"}, set(), {"b"})
    >>> status.assert_nontrivial_match().matched
    {'w'}
    >>> status.assert_existing_objects_matched()
    Traceback (most recent call last):
    ...
    AssertionError: ckpt-1: objects without a value in the checkpoint: ['b']
"""

__all__ = ["CheckpointLoadStatus", "InitializationOnlyStatus", "refuse_no_match"]


def refuse_no_match(path: str, matched, missing, unmatched) -> None:
    """A restore where our objects and the file's values exist but none met (the paths
    differ throughout) restores nothing: ``ValueError``, even where ``expect_partial()``
    would follow (TensorFlow's ``assert_nontrivial_match``). The same on every rank: the
    ranks agreed the plan the sets come from."""
    ours = sorted(set(missing) - {"save_counter"})
    theirs = sorted(set(unmatched) - {"save_counter"})
    if matched - {"save_counter"} or not ours or not theirs:
        return
    raise ValueError(
        f"restoring {path}: none of our {len(ours)} objects found a value among the file's "
        f"{len(theirs)}: the paths differ throughout (ours: {ours[:3]}, the file's: "
        f"{theirs[:3]}); nothing was restored. Build the objects as they were saved (the same "
        f"attribute names)")


class CheckpointLoadStatus:
    """What a restore matched; the ``assert_*`` methods raise ``AssertionError``.

    ``assert_consumed`` and ``assert_existing_objects_matched`` first restore pending values
    into objects created since the restore (``apply_pending``), then judge the graph as it is.
    """

    def __init__(self, path: str, matched, unmatched_values, missing_objects, refresh=None):
        self.path = path
        self.matched = set(matched)
        self.unmatched_values = set(unmatched_values)  # in the file, no object (yet)
        self.missing_objects = set(missing_objects)    # objects with no value in the file
        self._refresh = refresh   # () -> objects now without a value (None: keep the old)

    def apply_pending(self) -> "CheckpointLoadStatus":
        """Restore values still pending into the objects that now exist anywhere in the
        checkpoint's graph (objects created after the restore: optimizer slots, a lazily
        built layer, a pytree attached deep inside another object)."""
        if self._refresh is not None:
            missing = self._refresh()
            if missing is not None:
                self.missing_objects = set(missing)
        return self

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Every value in the file found its object, and every object its value."""
        self.apply_pending()
        if self.unmatched_values:
            raise AssertionError(f"{self.path}: values with no object to restore into: "
                                 f"{sorted(self.unmatched_values)}")
        return self._existing_matched()

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Every object now tracked got a value from the file."""
        self.apply_pending()
        return self._existing_matched()

    def _existing_matched(self) -> "CheckpointLoadStatus":
        if self.missing_objects:
            raise AssertionError(f"{self.path}: objects without a value in the checkpoint: "
                                 f"{sorted(self.missing_objects)}")
        return self

    def assert_nontrivial_match(self) -> "CheckpointLoadStatus":
        """At least one object other than the save counter was restored."""
        if not self.matched - {"save_counter"}:
            raise AssertionError(f"{self.path}: nothing but the save counter was restored")
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Accept a partial restore (nothing is warned about here)."""
        return self

    def run_restore_ops(self, session=None) -> None:
        """Restores happen eagerly; kept for compatibility."""


class InitializationOnlyStatus(CheckpointLoadStatus):
    """The status of ``restore(None)``: nothing was restored."""

    def __init__(self):
        super().__init__("(no checkpoint)", (), (), ())

    def assert_consumed(self):
        raise AssertionError("no checkpoint was restored (restore(None))")

    assert_existing_objects_matched = assert_nontrivial_match = assert_consumed
