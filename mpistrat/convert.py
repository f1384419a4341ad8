"""``python -m mpistrat convert SRC DST``: TensorFlow checkpoints to ours and back.

    mpirun -n 4 python -m mpistrat convert tf_run/ckpt-7 ours/ckpt-7      # -> ours/ckpt-7.h5
    mpirun -n 4 python -m mpistrat convert ours/ckpt-7 tf_again/ckpt-7    # -> .index + .data-*

``SRC`` is a TensorFlow prefix (``ckpt-7``, with ``ckpt-7.index`` beside), one of ours
(``ckpt-7`` or ``ckpt-7.h5``), or a directory (its latest checkpoint, by its state file);
the other format is written at the prefix ``DST`` (an existing one only with
``--overwrite``). Collective over the ranks it is started with: reading is shared as in a
restore (each value read by one rank) and so is writing (ours: partitions written by every
rank; TensorFlow's: one data shard per rank, ``DST.data-R-of-N``, and the index by rank 0).

Object paths carry over: a TensorFlow value's path is its object's first path in the
object graph (``model/dense/kernel``; other attributes ``PATH/NAME``, saved as state), and
ours become TensorFlow nodes of the same names, so ``tf.train.Checkpoint(model=...)``
restores them. Each TensorFlow value's own name (``full_name``) and key are kept as
attributes, and the source's object graph on the file (``checkpoint/tf_origin.py``): a
converted Keras checkpoint restores into the Keras 3 model by its variables' paths, and
converting it back writes the original keys and graph (a TF1 checkpoint keeps its TF1 names),
so TensorFlow restores the result into the original objects. Names need not be ASCII.
Values our format cannot hold (strings; other dtypes it refuses) stop the conversion,
naming their keys, unless ``--skip-unsupported`` leaves them out (each key named in the
summary). Keys that become one object path here, or a value that would lie inside another
(``a/b`` and ``a/b/c``), are refused naming both, before anything is written. Rank 0 prints
what was converted.
"""

import argparse
import os
import sys
from contextlib import closing
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["main", "convert"]


def _source(src: str) -> Tuple[str, str]:
    """``("tensorflow", prefix)`` or ``("mpistrat", file.h5)`` for ``src`` (this rank's view)."""
    from mpistrat.checkpoint.files import data_file
    from mpistrat.checkpoint.tf_checkpoints import latest_in
    from mpistrat.errors import NotFoundError
    from mpistrat.tfformats.bundle import is_bundle
    path = src[:-6] if src.endswith(".index") else src
    if os.path.isdir(path):
        path = latest_in(path)
    if os.path.isfile(data_file(path)):
        return "mpistrat", data_file(path)
    if is_bundle(path):
        return "tensorflow", path
    raise NotFoundError(f"no checkpoint at {src}: neither {data_file(path)} (ours) nor "
                        f"{path}.index (TensorFlow's) exists")


_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
_GRAPH = "\x00graph"          # the graph's place among the values read (never a path)


def _unsupported(path: str, entry) -> Optional[str]:
    """Why ours cannot hold this value (``None`` if it can): the writer's own rule
    (``checkpoint/dtypes.to_stored``: bfloat16 and float8 are held as raw bits)."""
    from mpistrat.checkpoint.dtypes import to_stored
    from mpistrat.checkpoint.graph import check_path
    if getattr(entry, "refused", ""):
        return f"TensorFlow dtype {entry.refused}"
    try:
        check_path(path)
    except ValueError:
        return f"its object path {path!r} has characters ours refuses"
    try:
        to_stored(np.empty(0, entry.dtype), path)
    except TypeError:
        return f"dtype {entry.dtype}" if entry.dtype != object else "strings"
    return None


def _keys_by_path(values) -> Dict[str, List[str]]:
    """Our object path -> the TensorFlow keys that become it (one, unless they collide):
    through the object graph, or without one (TF1's ``Saver``, a bundle written by hand) the
    key itself, less a TF2 ``/.ATTRIBUTES/VARIABLE_VALUE``."""
    from mpistrat.tfformats.object_graph import GRAPH_KEY
    groups: Dict[str, List[str]] = {}
    if values.graph is None:
        for key in sorted(values.index.entries):
            if key != GRAPH_KEY:
                groups.setdefault(key[:-len(_VALUE)] if key.endswith(_VALUE) else key,
                                  []).append(key)
        return groups
    groups = {path: [key] for path, key in values.by_path.items()}
    groups.update({path: list(keys) for path, keys in values.collisions.items()})
    return groups


def _nested(paths: Dict[str, str]) -> List[str]:
    """Pairs of kept values of which one lies inside the other (``a/b`` and ``a/b/c``): an
    HDF5 name is a dataset or a group, never both. Sorted with '/' lowest, a path's first
    follower is inside it if any is."""
    order = sorted(paths, key=lambda p: p.replace("/", "\x00"))
    return [f"{paths[a]} (object path {a!r}) and {paths[b]} (object path {b!r})"
            for a, b in zip(order, order[1:]) if b.startswith(a + "/")]


def _graph_to_keep(values, skipped_keys: set) -> Tuple[Optional[str], set]:
    """The graph's entry key (``None`` without a graph) and the checkpoint keys of its
    attributes whose values are left out (to drop from the graph kept with the values)."""
    from mpistrat.tfformats.object_graph import GRAPH_KEY, attribute_keys
    if values.graph is None:
        return None, set()
    drop = set()
    for value, keys in zip(values.graph.values,   # (a saveable's keys under its attribute's)
                           attribute_keys(values.graph, values.index.entries, values.source)):
        if any(key in skipped_keys for key in keys):
            drop.add(value.key)
    return GRAPH_KEY, drop


def _tf_to_ours(prefix: str, dst: str, engine, skip: bool) -> Tuple[int, int, List[str]]:
    from mpistrat.checkpoint.formats import READERS, WRITERS
    from mpistrat.checkpoint.tf_origin import TFOrigin
    from mpistrat.errors import InvalidArgumentError
    from mpistrat.tfformats.object_graph import GRAPH_KEY, VARIABLE_VALUE, drop_attributes
    reader = READERS["tensorflow"].open(prefix, engine)
    values = reader.values   # (TensorFlow's keys, collisions and graph decide what is kept)
    groups = _keys_by_path(values)
    collided = {path: keys for path, keys in groups.items() if len(keys) > 1}
    if collided:   # (one of our paths cannot hold two values)
        raise InvalidArgumentError(f"{prefix}: TensorFlow keys that become one object path "
                                   f"here: " + "; ".join(f"{p!r} from {k}" for p, k in sorted(
                                       collided.items())) + ": nothing was written")
    graph = values.graph
    names = {v.path: v.name for v in graph.values} if graph else {}
    full_names = {v.path: v.full_name for v in graph.values if v.full_name} if graph else {}
    entries, kinds, keys, skipped = {}, {}, {}, []
    for path in sorted(groups):
        key = groups[path][0]
        entry = values.index.entries[key]
        why = _unsupported(path, entry)
        if why is not None:
            skipped.append((key, why))
            continue
        entries[path], keys[path] = entry, key
        kinds[path] = "variable" if names.get(path, VARIABLE_VALUE) == VARIABLE_VALUE \
            else "state"
    named = {k for found in groups.values() for k in found} | {GRAPH_KEY}
    skipped += [(key, "no object path in its object graph")   # (every dropped value named)
                for key in sorted(set(values.index.entries) - named)]
    listed = [f"{key} ({why})" for key, why in skipped]
    if skipped and not skip:
        raise InvalidArgumentError(f"{prefix}: our checkpoints cannot hold {', '.join(listed)}; "
                                   f"pass --skip-unsupported to convert the rest")
    nested = _nested(keys)
    if nested:
        raise InvalidArgumentError(f"{prefix}: TensorFlow keys whose values would lie one "
                                   f"inside the other here (an HDF5 name is a value or holds "
                                   f"others, not both): {'; '.join(nested)}: nothing was "
                                   f"written")
    graph_key, drop = _graph_to_keep(values, {key for key, _ in skipped})
    wanted = dict(entries)
    if graph_key is not None:
        wanted[_GRAPH] = values.index.entries[graph_key]
    read: Dict[str, np.ndarray] = {}
    with closing(reader.read(wanted)) as batches:
        for batch in batches:
            read.update(batch)
    kept = read.pop(_GRAPH, None)
    if kept is not None:
        kept = drop_attributes(kept[()], drop, f"{prefix}, key {GRAPH_KEY!r}")
    origin = TFOrigin({p: n for p, n in full_names.items() if p in read}, keys, kept)
    WRITERS["mpistrat"](dst, engine, kinds, origin).write(read)
    return len(read), sum(v.nbytes for v in read.values()), listed


def _ours_to_tf(final: str, dst: str, engine) -> Tuple[int, int, List[str]]:
    from mpistrat.checkpoint.formats import READERS, WRITERS
    from mpistrat.errors import InvalidArgumentError
    from mpistrat.tfformats import bundle
    reader = READERS["mpistrat"].open(final, engine)
    catalog = reader.entries
    paths = sorted(catalog)
    refused = []
    for path in paths:
        try:
            bundle.dtype_enum(catalog[path].dtype)
        except InvalidArgumentError:
            refused.append(f"{path} ({catalog[path].dtype})")
    if refused:   # (the catalog is agreed: every rank raises alike, before any write)
        raise InvalidArgumentError(f"{final}: TensorFlow has no dtype for {', '.join(refused)}: "
                                   f"nothing was written")
    what = f"converting {final} to {dst}"
    origin = reader.origin(what)   # converted from TensorFlow: its own keys and graph
    writer = WRITERS["tensorflow"](dst, engine, {p: catalog[p].kind for p in paths},
                                   {p: catalog[p].nbytes for p in paths}, origin, what)
    with closing(reader.read(catalog)) as batches:
        for batch in batches:   # about 64 MiB at a time; each rank keeps what it writes
            writer.add(batch)
    writer.finish()
    return len(paths), sum(catalog[p].nbytes for p in paths), []


def convert(src: str, dst: str, overwrite: bool = False, skip_unsupported: bool = False):
    """Convert checkpoint ``src`` to the other format at prefix ``dst`` (collective).

    Returns ``(direction, values converted, bytes, skipped)``.
    """
    from mpistrat.checkpoint.directory import io_engine, prepare_directory
    from mpistrat.checkpoint.files import data_file
    from mpistrat.collectives.agreement import agree_view
    from mpistrat.tfformats.bundle import index_name
    engine = io_engine()
    source = None
    with engine.agreed(f"converting {src}"):
        source = _source(os.fspath(src))
    kind, path = agree_view(engine, source, f"checkpoint {src}")
    dst = os.fspath(dst)
    if agree_view(engine, os.path.isdir(dst) or dst.endswith(os.sep), f"DST {dst}"):
        raise IsADirectoryError(f"DST {dst} is a directory: give a checkpoint prefix, such as "
                                f"{os.path.join(dst, 'ckpt')}")
    target = index_name(dst) if kind == "mpistrat" else data_file(dst)
    if agree_view(engine, os.path.exists(target), target) and not overwrite:
        raise FileExistsError(f"{target} exists: choose another DST or pass --overwrite")
    prepare_directory(os.path.dirname(dst) or ".", engine, dst)
    if kind == "tensorflow":
        return ("tensorflow -> mpistrat",) + _tf_to_ours(path, dst, engine, skip_unsupported)
    return ("mpistrat -> tensorflow",) + _ours_to_tf(path, dst, engine)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpistrat convert",
                                     description="TensorFlow checkpoints to ours and back")
    parser.add_argument("src", help="a checkpoint prefix (either format) or a directory")
    parser.add_argument("dst", help="the prefix to write the other format at")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="leave out values our format cannot hold (strings, ...)")
    args = parser.parse_args(argv)
    from mpistrat.runtime import get_world
    try:
        direction, count, nbytes, skipped = convert(args.src, args.dst, args.overwrite,
                                                    args.skip_unsupported)
    except (ValueError, OSError) as err:  # the same on every rank: said once
        if get_world().rank == 0:
            sys.stderr.write(f"python -m mpistrat convert: {type(err).__name__}: {err}\n")
            sys.stderr.flush()
        return 1
    if get_world().rank == 0:
        sys.stdout.write(f"{direction}: {count} values ({nbytes} bytes) from {args.src} to "
                         f"{args.dst}" + (f"; skipped {len(skipped)}: {', '.join(skipped)}"
                                          if skipped else "") + "\n")
        sys.stdout.flush()
    return 0
