"""What decides the order of a pipeline's rows, as a few numbers an iterator's state carries.

A distributed iterator saved in a checkpoint resumes by position (epoch, step,
seed). The position means the same rows only in a pipeline that orders its rows
as the saved one did, so the state carries this pipeline's fingerprint: one
int64 per part, parts disjoint so that a change is named by the part it touched.

* ``rows``: the rows of every source (a file that grew, a longer array);
* ``files``: the files read, by base name and size (a file added, renamed or
  replaced; a copy of the same files in another directory is the same input);
* ``batch``: the global batch size (the outermost ``batch``);
* ``seeds``: the seeds given to ``shuffle`` and ``global_shuffle`` (unseeded
  shuffles take the seed the position carries);
* ``operations``: the operations that decide which rows come, and in what order
  (``batch``'s ``drop_remainder``, ``filter``, ``repeat``, ``take``/``skip``/
  ``shard``, ``zip``, ``unbatch``, shuffles and their buffers, ``reshuffle``).

``map`` (its function, its workers) and ``prefetch`` change no row's place and
are left out; the width (ranks) is not part of it either, as the position
carries over to another width::

    >>> from mpistrat.data import Dataset
    >>> a = pipeline_parts(Dataset.range(200).global_shuffle(seed=1).batch(60)._node)
    >>> b = pipeline_parts(Dataset.range(200).global_shuffle(seed=1).batch(50)._node)
    >>> changed_parts(a, b)
    ['the global batch size (60 when saved, 50 now)']
    >>> c = pipeline_parts(Dataset.range(200).map(lambda x: x + 1).global_shuffle(seed=1)
    ...                    .batch(60).prefetch(2)._node)
    >>> changed_parts(a, c)
    []
"""

import hashlib
import os
from typing import Dict, List, Mapping

from mpistrat.data import ops

__all__ = ["PARTS", "pipeline_parts", "changed_parts"]

PARTS = ("rows", "files", "batch", "seeds", "operations")   # the keys, in this order
_UNKNOWN = -1


def _digest(items) -> int:
    """A stable signed 64-bit digest of ``repr(items)`` (the same in every process)."""
    raw = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _operation(node: ops.Node):
    """What of ``node`` decides the rows' order, without its seed or batch size."""
    kind = type(node).__name__
    if kind in ("Map", "Prefetch"):
        return None
    if kind == "Cache":   # it changes the order only by freezing a reshuffle below it
        below = ops.walk(node)
        return ("Cache",) if any(getattr(n, "reshuffle", False) for n in below) else None
    if kind == "Source" or getattr(node, "reader", None) is not None:
        return ("source", node.name if kind == "Source" else type(node.reader).__name__)
    fields = [getattr(node, f, None) for f in
              ("drop_remainder", "count", "start", "stop", "step", "buffer_size", "reshuffle")]
    if kind == "Zip":
        fields.append(len(node.inputs))
    if kind == "Filter":
        fields.append(getattr(node.predicate, "__qualname__", type(node.predicate).__name__))
    return (kind, tuple(fields))


def pipeline_parts(root: ops.Node) -> Dict[str, int]:
    """The fingerprint of the pipeline under ``root``: ``{part: int64}`` for each of ``PARTS``."""
    nodes = ops.walk(root)
    rows, files = 0, []
    for node in nodes:
        reader = getattr(node, "reader", None)
        if reader is not None:
            files += [(os.path.basename(view[0]), view[1]) for view in reader.views]
        if isinstance(node, ops.Source) or reader is not None:
            length = node.cardinality()
            rows = _UNKNOWN if rows == _UNKNOWN or length < 0 else rows + length
    if any(type(node).__name__ == "Generator" for node in nodes):
        rows = _UNKNOWN
    batch = next((node.batch_size for node in nodes if type(node).__name__ == "Batch"),
                 _UNKNOWN)
    seeds = [node.seed for node in nodes if hasattr(node, "reshuffle")]
    operations = [op for op in map(_operation, nodes) if op is not None]
    return {"rows": rows, "files": _digest(files), "batch": batch, "seeds": _digest(seeds),
            "operations": _digest(operations)}


def changed_parts(saved: Mapping[str, int], now: Mapping[str, int]) -> List[str]:
    """What differs between two fingerprints, in words (empty when they match)."""
    def count(value: int) -> str:
        return "unknown" if value == _UNKNOWN else str(value)

    changes = []
    for part in PARTS:
        if part not in saved or part not in now or int(saved[part]) == int(now[part]):
            continue
        old, new = int(saved[part]), int(now[part])
        changes.append({
            "rows": f"the rows of its sources ({count(old)} when saved, {count(new)} now)",
            "files": "the files it reads (names or sizes)",
            "batch": f"the global batch size ({count(old)} when saved, {count(new)} now)",
            "seeds": "the seed of a shuffle",
            "operations": "its operations (filter, repeat, take, skip, shard, zip, unbatch, "
                          "a shuffle's buffer, drop_remainder)",
        }[part])
    return changes
