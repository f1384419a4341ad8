"""Our HDF5 checkpoints behind the format interface (``formats.py``): ``H5Reader`` over
``h5read`` (the validated catalog, values read collectively in 64 MiB batches, or by one
rank alone for values attached later) and ``H5Writer`` over ``h5write``.

A restore matches our objects to the file's paths: the same path, or for a file converted
from TensorFlow, TensorFlow's structural rule on its paths first
(``tf_structure.match_converted``), then a Keras 3 variable's by TensorFlow's name
(``keras_names.py``). A Flax NNX object restores whole or not at all
(``frameworks.whole_objects``). The values no object took stay pending in the reader.
"""

import hashlib
from typing import Any, Callable, Dict, Iterator, Optional, Set

import numpy as np

from mpistrat.checkpoint.files import data_file
from mpistrat.checkpoint.frameworks import whole_objects
from mpistrat.checkpoint.graph import required_paths
from mpistrat.checkpoint.h5read import Entry, Reader, read_catalog, read_entry, read_values
from mpistrat.checkpoint.h5write import write_file
from mpistrat.checkpoint.keras_names import KerasNames
from mpistrat.checkpoint.matching import read_batches
from mpistrat.checkpoint.tf_origin import TFOrigin, read_graph
from mpistrat.checkpoint.tf_structure import match_converted
from mpistrat.collectives.agreement import agree_view
from mpistrat.errors import DataLossError
from mpistrat.tfformats.object_graph import GRAPH_KEY, parse_graph

__all__ = ["H5Reader", "H5Writer"]

PENDING_LABEL = "the restored checkpoint"   # what values attached later are restored from


class H5Reader:
    """One of our checkpoint files, opened on every rank (``open``: collective)."""

    kind = "mpistrat"

    def __init__(self, final: str, catalog: Dict[str, Entry], engine):
        self.source, self.label = final, final   # (``label``: once pending, PENDING_LABEL)
        self.catalog, self.engine = catalog, engine
        self.remaining = dict(catalog)          # values no object took (yet)
        self.saved = set(catalog)               # every path the file holds

    @classmethod
    def open(cls, final: str, engine) -> "H5Reader":
        """The validated catalog of ``final``, the same on every rank (collective)."""
        return cls(final, read_catalog(final, engine), engine)

    # -- listing ------------------------------------------------------------------------
    @property
    def entries(self) -> Dict[str, Entry]:
        """Checkpoint path -> entry (``shape``, ``dtype``, ``kind``, ``nbytes``)."""
        return self.catalog

    def entry(self, path: str) -> Entry:
        return self.catalog[path]

    def __len__(self) -> int:
        return len(self.remaining)

    def paths(self) -> Set[str]:
        """Checkpoint paths of the values still without an object."""
        return set(self.remaining)

    # -- matching -----------------------------------------------------------------------
    def match(self, slots, named: Dict[str, Any], root: Any = None) -> Dict[str, str]:
        """Our path -> the file's path of the value it restores from (among those left)."""
        catalog = self.remaining
        names = {p: e.tf_full_name for p, e in catalog.items() if e.tf_full_name}
        found = match_converted(catalog, slots, named, root) if names and named is not None \
            else {path: path for path in set(slots) & set(catalog)}
        if names and len(found) < len(slots):
            found = KerasNames(names, lambda p: catalog[p].shape, self.label).match(slots, found)
        return found

    def checker(self, named, slots, found, check: Callable) -> Callable:
        """The per-value check: ``check``, after the NNX objects are checked whole."""
        return whole_objects(named, slots, self.remaining, check)

    def refuse(self, found: Dict[str, str]) -> None:
        """Nothing the file itself refuses once matched."""

    def missing(self, slots, found: Dict[str, str]) -> Set[str]:
        return required_paths(slots) - self.known(found)

    def known(self, found: Dict[str, str]) -> Optional[Set[str]]:
        """Our paths that have a value in the file (by its path, or matched by name)."""
        return self.saved | set(found)

    # -- reading ------------------------------------------------------------------------
    def read(self, wanted: Dict[str, Entry]) -> Iterator[Dict[str, np.ndarray]]:
        """``wanted`` (our path -> entry) on every rank, in batches of about 64 MiB, every
        value checksummed (collective)."""
        with Reader(wanted, self.engine) as reader:
            for batch in read_batches(wanted):  # old values freed as we go
                yield read_values(self.source, reader, batch)

    def read_local(self, entry: Entry) -> np.ndarray:
        """The whole value of ``entry``, read and verified by this rank alone."""
        return read_entry(entry)

    def array_types(self, wanted: Dict[str, Entry]) -> Dict[str, str]:
        """Our path -> the type of array a value was saved from (``"jax"``; ``""``: NumPy)."""
        return {p: e.array_type for p, e in wanted.items() if e.kind == "array"}

    # -- pending values -----------------------------------------------------------------
    def keep_pending(self, used: Set[str]) -> None:
        """After the restore: the values it used are gone; the rest wait for objects."""
        self.consume(used)
        self.catalog = self.remaining   # (the used entries' files close with them)
        self.label = PENDING_LABEL

    def consume(self, used: Set[str]) -> None:
        for path in used:
            self.remaining.pop(path, None)

    def hook_unbuilt(self, checkpoint, named) -> None:
        """No object graph to bind: the checkpoint's own hooks suffice."""

    # -- what it keeps of TensorFlow (``convert``) --------------------------------------
    def origin(self, what: str) -> TFOrigin:
        """The TensorFlow keys of a file converted from TensorFlow (agreed across ranks;
        ``None`` for one of ours) and its kept object graph (rank 0 reads it)."""
        engine, keys, graph = self.engine, None, None
        with engine.agreed(what, doing="reading its TensorFlow keys"):
            keys = _tf_keys(self.catalog, self.source)
        agree_view(engine, None if keys is None else hashlib.sha1(repr(sorted(keys.items())).encode(
            )).hexdigest(), f"{self.source} (its TensorFlow keys)", error=DataLossError)
        if keys is not None:
            with engine.agreed(what, doing="reading the kept object graph"):
                if engine.rank == 0:
                    graph = _kept_graph(self.source)
        return TFOrigin(keys=keys, graph=graph)

    def close(self) -> None:
        """Drop the catalog (its files close with their last entry)."""
        self.catalog, self.remaining = {}, {}


def _tf_keys(catalog: Dict[str, Entry], final: str) -> Optional[Dict[str, str]]:
    """The TensorFlow key of every value of a checkpoint converted from TensorFlow (``None``
    for one of ours, or if any value lacks one); ``DataLossError`` if two values claim one
    key, or a key TensorFlow could not hold."""
    keys = {path: entry.tf_key for path, entry in catalog.items()}
    if not keys or not all(keys.values()):
        return None
    owner: Dict[str, str] = {}
    for path, key in sorted(keys.items()):
        if key == GRAPH_KEY or key.startswith("\x00"):
            raise DataLossError(f"{final}, object {path!r}: TensorFlow key {key!r} is reserved")
        if key in owner:
            raise DataLossError(f"{final}: objects {owner[key]!r} and {path!r} both claim "
                                f"TensorFlow key {key!r}")
        owner[key] = path
    return keys


def _kept_graph(final: str) -> Optional[bytes]:
    """The object graph kept by the conversion from TensorFlow (checked: a graph), or
    ``None``. (Its keys are TensorFlow's: an attribute whose key the source lacked, as
    TensorFlow's sharded writes leave out empty tensors, is kept as it was.)"""
    graph = read_graph(final)
    if graph is not None:
        parse_graph(graph, f"{final}, its kept {GRAPH_KEY}")
    return graph


class H5Writer:
    """Writes one of our checkpoint files at ``prefix`` (``PREFIX.h5``), collectively;
    ``origin``: what a conversion keeps of TensorFlow (``tf_origin.py``)."""

    kind = "mpistrat"

    def __init__(self, prefix: str, engine, kinds: Dict[str, str],
                 origin: Optional[TFOrigin] = None, mode: Optional[str] = None):
        self.final, self.engine, self.kinds = data_file(prefix), engine, kinds
        self.origin, self.mode = origin or TFOrigin(), mode
        self.values: Dict[str, np.ndarray] = {}

    def add(self, values: Dict[str, np.ndarray]) -> None:
        """Values to write (the same on every rank), kept until ``finish``."""
        self.values.update(values)

    def finish(self) -> None:
        """Write the file, atomically (collective; ``h5write.write_file``)."""
        origin = self.origin
        write_file(self.final, self.values, self.kinds, self.engine, self.mode,
                   tf_names=origin.names, tf_keys=origin.keys, tf_graph=origin.graph)

    def write(self, values: Dict[str, np.ndarray]) -> None:
        self.add(values)
        self.finish()

