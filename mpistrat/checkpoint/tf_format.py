"""TensorFlow's tensor bundle behind the format interface (``formats.py``): ``TFReader``
over ``tf_checkpoints`` (the index agreed by every rank, our objects matched through the
object graph as TensorFlow matches them, each value read by one rank with MPI-IO and
broadcast, CRC checked everywhere) and ``TFWriter`` over ``tfformats.bundle_writer`` (one
data shard per rank, the index by rank 0).
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from mpistrat.checkpoint.graph import required_paths
from mpistrat.checkpoint.tf_checkpoints import (TensorFlowValues, assign_readers, open_values,
                                                read_collective)
from mpistrat.checkpoint.tf_origin import TFOrigin
from mpistrat.checkpoint.tf_structure import hook_unbuilt, refuse_saved_model
from mpistrat.tfformats import bundle, bundle_writer
from mpistrat.tfformats.bundle import BundleEntry, read_value
from mpistrat.tfformats.object_graph import GRAPH_KEY, ObjectGraph, build_graph

__all__ = ["TFReader", "TFWriter"]


class TFReader:
    """One TensorFlow checkpoint (a bundle prefix), opened on every rank (``open``:
    collective). Its paths are our object paths (``TensorFlowValues``)."""

    kind = "tensorflow"

    def __init__(self, values: TensorFlowValues, engine):
        self.values, self.engine = values, engine
        self.source = self.label = values.source
        self.restored = False    # once the restore is done, values wait for later objects

    @classmethod
    def open(cls, prefix: str, engine) -> "TFReader":
        """The validated index and graph of ``prefix``, the same on every rank (collective)."""
        return cls(open_values(prefix, engine), engine)

    # -- listing ------------------------------------------------------------------------
    @property
    def entries(self) -> Dict[str, BundleEntry]:
        """Checkpoint path (our object path) -> entry (``shape``, ``dtype``, ``nbytes``)."""
        return {path: self.values.entry(path) for path in self.values.by_path}

    def entry(self, path: str) -> BundleEntry:
        return self.values.entry(path)

    @property
    def graph(self) -> Optional[ObjectGraph]:
        """The object graph (``None``: TF1, or a bundle written by hand)."""
        return self.values.graph

    def __len__(self) -> int:
        return len(self.values.unmatched)

    def paths(self) -> Set[str]:
        return set(self.values.unmatched)

    # -- matching -----------------------------------------------------------------------
    def match(self, slots, named: Dict[str, Any], root: Any = None) -> Dict[str, str]:
        """Our path -> the checkpoint path, by TensorFlow's rule then by our paths
        (``TensorFlowValues.match``), among the values no object took yet."""
        unmatched = self.values.unmatched
        return {p: t for p, t in self.values.match(slots, named, root).items() if t in unmatched}

    def checker(self, named, slots, found: Dict[str, str], check: Callable) -> Callable:
        """``check``; in the restore, first refusing a path that several keys became."""
        if self.restored:
            return check
        collisions = self.values.collisions

        def checked(slot, entry, path, source):   # (two keys that became one path: ambiguous)
            if found[path] in collisions:
                raise ValueError(f"cannot restore {path!r} from {source}: TensorFlow keys "
                                 f"{collisions[found[path]]} both become this object path "
                                 f"here, so which value it should take is ambiguous")
            check(slot, entry, path, source)
        return checked

    def refuse(self, found: Dict[str, str]) -> None:
        """A SavedModel's variables, which nothing of ours can match (``tf_structure``)."""
        refuse_saved_model(self.values, found, self.source)

    def missing(self, slots, found: Dict[str, str]) -> Set[str]:
        missing = required_paths(slots) - set(found)
        if "save_counter" not in self.values.by_path:  # TensorFlow makes it on the first save()
            missing.discard("save_counter")
        return missing

    def known(self, found: Dict[str, str]) -> Optional[Set[str]]:
        """``None``: the checkpoint's paths are TensorFlow's, not ours to compare later."""
        return None

    # -- reading ------------------------------------------------------------------------
    def read(self, wanted: Dict[str, BundleEntry]) -> Iterator[Dict[str, np.ndarray]]:
        """``wanted`` (any name -> entry) on every rank, in dicts of about 64 MiB (collective)."""
        yield from read_collective(wanted, self.engine)

    def read_local(self, entry: BundleEntry) -> np.ndarray:
        return read_value(entry)

    def array_types(self, wanted) -> Dict[str, str]:
        return {}

    # -- pending values -----------------------------------------------------------------
    def keep_pending(self, used: Set[str]) -> None:
        self.consume(used)
        self.restored = True

    def consume(self, used: Set[str]) -> None:
        self.values.unmatched -= used

    def hook_unbuilt(self, checkpoint, named) -> None:
        """Keras objects bound to the graph but not built yet restore when built."""
        hook_unbuilt(checkpoint, self.values.graph, named)

    def close(self) -> None:
        """Nothing held open: every read opens and closes its shards."""


class TFWriter:
    """Writes a TensorFlow checkpoint at ``prefix`` (collective): each value is written by
    the rank that ``assign_readers`` deals it to, into that rank's data shard
    (``PREFIX.data-R-of-N``); rank 0 writes the index. Our paths become TensorFlow nodes of
    the same names (``build_graph``), unless ``origin`` gives the keys (and the graph)."""

    kind = "tensorflow"

    def __init__(self, prefix: str, engine, kinds: Dict[str, str], sizes: Dict[str, int],
                 origin: Optional[TFOrigin] = None, what: str = ""):
        self.prefix, self.engine = prefix, engine
        self.what = what or f"writing {prefix}"
        graph, keys = (origin.graph, origin.keys) if origin is not None and origin.keys \
            is not None else build_graph({p: kinds[p] for p in sorted(kinds)})
        self.keys = keys
        paths = sorted(sizes)
        self.owners = dict(zip(paths, assign_readers([sizes[p] for p in paths], engine.size)))
        self.mine: List[Tuple[str, np.ndarray]] = []
        if graph is not None and engine.rank == 0:
            self.mine.append((GRAPH_KEY, np.array(graph, dtype=object)))

    def add(self, values: Dict[str, np.ndarray]) -> None:
        """Values read so far (the same on every rank): this rank keeps those it writes."""
        for path, value in values.items():
            if self.owners[path] == self.engine.rank:
                self.mine.append((self.keys[path], value))

    def finish(self) -> None:
        engine, prefix, entries = self.engine, self.prefix, []
        with engine.agreed(self.what, doing="writing a data shard"):
            entries = bundle_writer.write_shard(bundle.data_name(prefix, engine.rank, engine.size),
                                                sorted(self.mine, key=lambda kv: kv[0].encode()),
                                                engine.rank)
        gathered = engine.gather_object(entries, 0, f"{self.what}: the entries")
        with engine.agreed(self.what, doing="writing the index"):
            if engine.rank == 0:
                bundle_writer.write_index(prefix, engine.size,
                                          [e for part in gathered for e in part])

    def write(self, values: Dict[str, np.ndarray]) -> None:
        self.add(values)
        self.finish()
