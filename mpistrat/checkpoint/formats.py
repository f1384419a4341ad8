"""The checkpoint formats behind one reader and one writer interface: our HDF5 files
(``h5format.py``) and TensorFlow's tensor bundles (``tf_format.py``). ``Checkpoint.restore``
reads either through ``CheckpointReader`` (``open_reader`` chooses, every rank alike);
``convert`` reads with one format's reader and writes with the other's writer.

A reader's paths are checkpoint paths (our object paths: a TensorFlow value's is its
object's first path in the object graph); the format's own rule matches our objects to
them (``match``). Values no object took stay in the reader, pending, until objects appear
(``keep_pending``, then ``match``/``read_local``/``consume`` on this rank alone).
"""

import os
from typing import Any, Callable, Dict, Iterator, Optional, Protocol, Set

import numpy as np

from mpistrat.checkpoint.files import data_file, local_view, missing_hint
from mpistrat.checkpoint.h5format import H5Reader, H5Writer
from mpistrat.checkpoint.same_path import agree_view_at
from mpistrat.checkpoint.tf_format import TFReader, TFWriter
from mpistrat.collectives.agreement import agree_view
from mpistrat.errors import NotFoundError
from mpistrat.tfformats.bundle import is_bundle

__all__ = ["CheckpointReader", "CheckpointWriter", "open_reader", "READERS", "WRITERS"]


class CheckpointReader(Protocol):
    """One checkpoint, opened on every rank (``open(path, engine)``: collective, validated
    and agreed, else ``NotFoundError``/``DataLossError`` on every rank)."""

    kind: str       # "mpistrat" or "tensorflow"
    source: str     # the file or prefix errors name
    label: str      # what restored values come from, in errors (pending: may differ)

    @property
    def entries(self) -> Dict[str, Any]:
        """Checkpoint path -> entry (``shape``, ``dtype``, ``nbytes``)."""

    def entry(self, path: str) -> Any: ...

    def __len__(self) -> int:
        """How many values are pending (no object took them yet)."""

    def paths(self) -> Set[str]:
        """The checkpoint paths of the pending values."""

    def match(self, slots, named: Dict[str, Any], root: Any = None) -> Dict[str, str]:
        """Our object path -> the checkpoint path of a pending value it restores from (the
        format's rule; variables bound outside our walk get slots, added to ``slots``)."""

    def checker(self, named, slots, found: Dict[str, str], check: Callable) -> Callable:
        """``check(slot, entry, path, source)`` with the format's own checks added."""

    def refuse(self, found: Dict[str, str]) -> None:
        """Raise (the same on every rank) for a plan the format refuses as a whole."""

    def missing(self, slots, found: Dict[str, str]) -> Set[str]:
        """Our required paths without a value in the checkpoint."""

    def known(self, found: Dict[str, str]) -> Optional[Set[str]]:
        """Our paths with a value in the checkpoint (``None``: not comparable later)."""

    def read(self, wanted: Dict[str, Any]) -> Iterator[Dict[str, np.ndarray]]:
        """The values of ``wanted`` (name -> entry) on every rank, in batches (collective)."""

    def read_local(self, entry: Any) -> np.ndarray:
        """One value, read and checked by this rank alone."""

    def array_types(self, wanted: Dict[str, Any]) -> Dict[str, str]:
        """Name -> the array type a value was saved from, for values rebuilt as saved."""

    def keep_pending(self, used: Set[str]) -> None:
        """End of the restore: drop the values used; the rest wait for their objects."""

    def consume(self, used: Set[str]) -> None:
        """Drop pending values now restored."""

    def hook_unbuilt(self, checkpoint, named: Dict[str, Any]) -> None:
        """Restore-on-build hooks the format knows of beyond ``checkpoint``'s own."""

    def close(self) -> None: ...


class CheckpointWriter(Protocol):
    """Writes one checkpoint at a prefix (made with the values' kinds; collective)."""

    kind: str

    def add(self, values: Dict[str, np.ndarray]) -> None:
        """Values to write, the same on every rank (in batches, as read)."""

    def finish(self) -> None:
        """Write the checkpoint's files, atomically, on every rank (collective)."""

    def write(self, values: Dict[str, np.ndarray]) -> None:
        """``add(values)``, then ``finish()``."""


READERS = {"mpistrat": H5Reader, "tensorflow": TFReader}
WRITERS = {"mpistrat": H5Writer, "tensorflow": TFWriter}


def open_reader(path: str, engine) -> CheckpointReader:
    """The reader of the checkpoint at prefix ``path`` (collective): TensorFlow's bundle when
    ``PATH.index`` is one and ``PATH.h5`` does not exist, else ours; the ranks agree on the
    choice and on ``path`` (``agree_view_at``), then on the file, before it is read."""
    tensorflow = is_bundle(path) and not os.path.exists(data_file(path))
    if agree_view_at(engine, path, tensorflow, f"{path}.index",  # TensorFlow's format?
                     f"restoring checkpoint {path}"):
        return TFReader.open(path, engine)
    final = data_file(path)
    if agree_view(engine, local_view(final), final) != "file":
        raise NotFoundError(f"no checkpoint at {path} (looked for {final}){missing_hint(path)}")
    return H5Reader.open(final, engine)
