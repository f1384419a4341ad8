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
restores them. Each TensorFlow variable's own name (``full_name``) is kept as an attribute,
so a converted Keras checkpoint restores into the Keras 3 model by its variables' paths, as
a restore from the TensorFlow files does (``checkpoint/keras_names.py``). Values our format cannot hold (strings; other dtypes it refuses) stop the
conversion, naming them, unless ``--skip-unsupported`` leaves them out. Rank 0 prints what
was converted.
"""

import argparse
import os
import sys
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
        return "its object path has characters ours refuses"
    try:
        to_stored(np.empty(0, entry.dtype), path)
    except TypeError:
        return f"dtype {entry.dtype}" if entry.dtype != object else "strings"
    return None


def _tf_to_ours(prefix: str, dst: str, engine, skip: bool) -> Tuple[int, int, List[str]]:
    from mpistrat.checkpoint.h5write import write_file
    from mpistrat.checkpoint.files import data_file
    from mpistrat.checkpoint.tf_checkpoints import open_values, read_collective
    from mpistrat.tfformats.object_graph import GRAPH_KEY, VARIABLE_VALUE
    values = open_values(prefix, engine)
    if values.collisions:   # (one of our paths cannot hold two values)
        raise ValueError(f"{prefix}: TensorFlow keys that become one object path here: "
                         + "; ".join(f"{p!r} from {k}" for p, k in sorted(
                             values.collisions.items())) + ": nothing was written")
    names = {v.path: v.name for v in values.graph.values} if values.graph else {}
    full_names = {v.path: v.full_name for v in values.graph.values if v.full_name} \
        if values.graph else {}
    entries, kinds, skipped = {}, {}, []
    for path in sorted(values.by_path):
        entry = values.entry(path)
        why = _unsupported(path, entry)
        if why is not None:
            skipped.append(f"{path} ({why})")
            continue
        entries[path] = entry
        kinds[path] = "variable" if names.get(path, VARIABLE_VALUE) == VARIABLE_VALUE \
            else "state"
    pathless = set(values.index.entries) - set(values.by_path.values()) - {GRAPH_KEY}
    skipped += [f"{key} (no object path in its object graph)"   # (every dropped value named)
                for key in sorted(pathless)]
    if skipped and not skip:
        raise ValueError(f"{prefix}: our checkpoints cannot hold {', '.join(skipped)}; pass "
                         f"--skip-unsupported to convert the rest")
    read: Dict[str, np.ndarray] = {}
    for batch in read_collective(entries, engine):
        read.update(batch)
    write_file(data_file(dst), read, kinds, engine,
               tf_names={p: n for p, n in full_names.items() if p in read})
    return len(read), sum(v.nbytes for v in read.values()), skipped


def _ours_to_tf(final: str, dst: str, engine) -> Tuple[int, int, List[str]]:
    from mpistrat.checkpoint.h5read import Reader, read_catalog, read_values
    from mpistrat.checkpoint.tf_checkpoints import assign_readers
    from mpistrat.collectives.agreement import Failure, agree_errors
    from mpistrat.tfformats import bundle, bundle_writer
    from mpistrat.tfformats.object_graph import GRAPH_KEY, build_graph
    catalog = read_catalog(final, engine)
    paths = sorted(catalog)
    graph, keys = build_graph({p: catalog[p].kind for p in paths})
    owners = assign_readers([catalog[p].nbytes for p in paths] + [len(graph)], engine.size)
    mine: List[Tuple[str, np.ndarray]] = []
    if owners[-1] == engine.rank:
        mine.append((GRAPH_KEY, np.array(graph, dtype=object)))
    batches, size = [[]], 0
    for path in paths:  # read in batches of about 64 MiB; keep what this rank writes
        if batches[-1] and size + catalog[path].nbytes > 64 << 20:
            batches.append([])
            size = 0
        batches[-1].append(path)
        size += catalog[path].nbytes
    with Reader(catalog, engine) as reader:
        for batch in batches:
            if batch:
                for path, value in read_values(final, reader, batch).items():
                    if owners[paths.index(path)] == engine.rank:
                        mine.append((keys[path], value))
    failure, entries = None, []
    try:
        entries = bundle_writer.write_shard(bundle.data_name(dst, engine.rank, engine.size),
                                            sorted(mine, key=lambda kv: kv[0].encode()),
                                            engine.rank)
    except OSError as err:
        failure = Failure(err, engine.rank, "writing a data shard")
    agree_errors(engine, failure, f"converting {final} to {dst}")
    gathered = engine.comm.gather(entries, root=0)
    failure = None
    if engine.rank == 0:
        try:
            bundle_writer.write_index(dst, engine.size, [e for part in gathered for e in part])
        except OSError as err:
            failure = Failure(err, 0, "writing the index")
    agree_errors(engine, failure, f"converting {final} to {dst}")
    return len(paths), sum(catalog[p].nbytes for p in paths), []


def convert(src: str, dst: str, overwrite: bool = False, skip_unsupported: bool = False):
    """Convert checkpoint ``src`` to the other format at prefix ``dst`` (collective).

    Returns ``(direction, values converted, bytes, skipped)``.
    """
    from mpistrat.checkpoint.directory import io_engine, prepare_directory
    from mpistrat.checkpoint.files import data_file
    from mpistrat.collectives.agreement import Failure, agree_errors, agree_view
    from mpistrat.tfformats.bundle import index_name
    engine = io_engine()
    failure, source = None, None
    try:
        source = _source(os.fspath(src))
    except Exception as err:  # noqa: BLE001 - agreed, then raised on every rank
        failure = Failure(err, engine.rank)
    agree_errors(engine, failure, f"converting {src}")
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
                         f"{args.dst}" + (f"; skipped {', '.join(skipped)}" if skipped else "")
                         + "\n")
        sys.stdout.flush()
    return 0
