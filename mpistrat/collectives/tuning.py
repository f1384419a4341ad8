"""The tuning table: which all-reduce algorithm each message size takes, from measurements.

A ``TuningTable`` maps (dtype size class, message-size bucket, place) to one algorithm
name. Buckets are powers of 4 from 4 KiB to 64 MiB; a buffer takes the bucket nearest its
size in log scale (below 2 KiB none: the static rules apply, MPI's own). Size classes are
``4`` (elements of 4 bytes or fewer) and ``8``. The place is ``"out"`` (the result goes
to a buffer of its own: a tensor the caller still holds) or ``"in"`` (the buffer is
overwritten: a fused bucket, a reproducible sum's grid): MPI's own in-place ``Allreduce``
and its out-of-place one are different programs, and which algorithm wins differs. The
table is made by ``calibration.calibrate``
(timings all-reduced with MAX, so every rank picks the same) or read from the tuning file
(``MPISTRAT_TUNING_FILE``), a JSON document keyed by host type, MPI library, ranks per node
and node count. Everything here is pure: no MPI::

    >>> table = TuningTable(key={"size": 2}, choices={(4, 4 << 20, "out"): "ring"}, source="x")
    >>> table.choose(5 << 20, 4), table.choose(5 << 20, 8), table.choose(100, 4)
    ('ring', None, None)
    >>> table.choose(5 << 20, 4, in_place=True) is None    # measured out of place only
    True
    >>> pick({"mpi": 1.0, "ring": 0.97})   # within the 5% margin: MPI's own
    'mpi'
"""

import json
import math
import os
import platform
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mpistrat.safe_files import UnreadableFile, read_regular

__all__ = ["TuningTable", "BUCKETS", "SIZE_CLASSES", "PLACES", "CANDIDATES", "VERSION",
           "bucket_of", "size_class", "key_of", "pick", "table_key", "load_table", "save_table",
           "parse_file",
           "TuningFileError"]

VERSION = 2              # 2: entries keyed by place too (version 1 measured out of place only)
FORMAT = "mpistrat-tuning"
BUCKETS: Tuple[int, ...] = tuple(4096 << (2 * i) for i in range(8))   # 4 KiB .. 64 MiB
SIZE_CLASSES = (4, 8)
PLACES = ("out", "in")   # the result into a buffer of its own, or over the input
# the algorithms the tuner compares, in the order ties are broken (MPI's own first)
CANDIDATES = ("mpi", "ring", "rabenseifner", "hierarchical")
MARGIN = 0.05           # another algorithm must beat MPI's own by this fraction
MAX_FILE_BYTES = 1 << 20  # a tuning file is small; a larger one is refused unread


class TuningFileError(ValueError):
    """A tuning file that is corrupt, foreign or stale (the message says which and why)."""


def size_class(itemsize: int) -> int:
    """The dtype size class of elements of ``itemsize`` bytes: 4 (up to 4 bytes) or 8."""
    return 4 if itemsize <= 4 else 8


def bucket_of(nbytes: int) -> Optional[int]:
    """The bucket nearest ``nbytes`` in log scale, or ``None`` below 2 KiB.

    >>> bucket_of(4096), bucket_of(6000), bucket_of(9000), bucket_of(1 << 30), bucket_of(1000)
    (4096, 4096, 16384, 67108864, None)
    """
    if nbytes < BUCKETS[0] // 2:
        return None
    index = round(math.log(nbytes / BUCKETS[0], 4))
    return BUCKETS[min(max(index, 0), len(BUCKETS) - 1)]


def key_of(nbytes: int, itemsize: int, in_place: bool = False) -> Optional[Tuple[int, int, str]]:
    """The table entry a buffer of ``nbytes`` takes: ``(size class, bucket, place)``, or
    ``None`` below the smallest bucket.

    >>> key_of(3 << 20, 4, in_place=True), key_of(100, 8)
    ((4, 4194304, 'in'), None)
    """
    bucket = bucket_of(nbytes)
    if bucket is None:
        return None
    return size_class(itemsize), bucket, PLACES[1] if in_place else PLACES[0]


def pick(times: Mapping[str, float], margin: float = MARGIN) -> str:
    """The fastest algorithm of ``times`` (seconds); MPI's own unless beaten by ``margin``.

    Ties go to the earlier name of ``CANDIDATES``; the result is a pure function of
    ``times``, so ranks holding the same (MAX-agreed) timings pick the same algorithm.
    """
    usable = {name: t for name, t in times.items() if math.isfinite(t) and t > 0}
    if not usable:
        return "mpi"
    order = sorted(usable, key=lambda n: (usable[n], CANDIDATES.index(n)
                                          if n in CANDIDATES else len(CANDIDATES), n))
    best = order[0]
    if "mpi" in usable and best != "mpi" and usable[best] > usable["mpi"] * (1 - margin):
        return "mpi"
    return best


@dataclass
class TuningTable:
    """Chosen algorithm per ``(size class, bucket, place)``, the key it was measured for,
    and where it came from (``source``: calibrated on this job, or a file path)."""

    key: Dict
    choices: Dict[Tuple[int, int, str], str]
    source: str = ""
    times: Dict[Tuple[int, int, str], Dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    # online refinement (collectives/refinement.py): real calls per trial (0: off), the
    # trials in progress, and the real means of the buckets that settled
    refine_calls: int = 0
    trials: Dict[Tuple[int, int, str], object] = field(default_factory=dict)
    online: Dict[Tuple[int, int, str], Dict[str, float]] = field(default_factory=dict)

    def choose(self, nbytes: int, itemsize: int, in_place: bool = False) -> Optional[str]:
        """The measured choice for a buffer, or ``None`` where the static rules apply."""
        key = key_of(nbytes, itemsize, in_place)
        return None if key is None else self.choices.get(key)

    def rows(self, online: bool = True) -> List[Dict]:
        """One row per measured entry (for ``info`` and the file): class, bytes, place, choice,
        times, and with ``online`` the real means of a bucket refined by real calls (``info``
        shows them; the file keeps the calibration)."""
        rows = []
        for key in sorted(self.choices, key=lambda k: (k[2] != PLACES[0], k[0], k[1])):
            c, b, place = key
            row = {"class": c, "bytes": b, "place": place, "algorithm": self.choices[key],
                   "times": _rounded(self.times.get(key, {}))}
            if online and self.online.get(key):
                row["online"] = _rounded(self.online[key])
            rows.append(row)
        return rows

    def to_json(self) -> Dict:
        return {"key": self.key, "calibration_seconds": round(self.seconds, 3),
                "entries": self.rows(online=False)}


def _rounded(times: Mapping[str, float]) -> Dict[str, float]:
    return {name: round(t, 9) for name, t in sorted(times.items())}


def host_type() -> str:
    """The machine and CPU model (``/proc/cpuinfo``'s model name where there is one)."""
    model = ""
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()} {' '.join(model.split())}".strip()


def table_key(mpi_library: str, ranks_per_node: int, nodes: int, size: int,
              host: Optional[str] = None) -> Dict:
    """The key a table is valid for: host type, MPI library, ranks per node, node count, size."""
    return {"host": host if host is not None else host_type(), "mpi": mpi_library,
            "ranks_per_node": int(ranks_per_node), "nodes": int(nodes), "size": int(size)}


# -- the file: hostile input, validated before use --------------------------------------------
def parse_file(text: str, key: Mapping, path: str = "<tuning file>") -> TuningTable:
    """The table for ``key`` in a tuning file's ``text``; ``TuningFileError`` naming ``path``
    when the text is corrupt (not our JSON), stale (another version or bucket grid) or foreign
    (no entry for this host type, MPI library and layout)."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise TuningFileError(f"{path}: corrupt (not JSON: {err})") from None
    except RecursionError:   # (a file of nested brackets)
        raise TuningFileError(f"{path}: corrupt (nested too deeply)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TuningFileError(f"{path}: corrupt (not an {FORMAT} document)")
    if doc.get("version") != VERSION:
        raise TuningFileError(f"{path}: stale (version {doc.get('version')!r}, this mpistrat "
                              f"reads version {VERSION}); run python -m mpistrat tune again")
    if doc.get("buckets") != list(BUCKETS):
        raise TuningFileError(f"{path}: stale (another bucket grid); run python -m mpistrat "
                              f"tune again")
    tables = doc.get("tables")
    if not isinstance(tables, list):
        raise TuningFileError(f"{path}: corrupt ('tables' is not a list)")
    for number, entry in enumerate(tables):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict):
            raise TuningFileError(f"{path}: corrupt (table {number} has no key)")
        if entry["key"] == dict(key):
            return _entry(entry, number, path)
    raise TuningFileError(f"{path}: foreign (no table for {dict(key)}; it holds "
                          f"{[t['key'] for t in tables]})")


def _entry(entry: Dict, number: int, path: str) -> TuningTable:
    where = f"{path}: corrupt (table {number}"
    rows = entry.get("entries")
    most = len(BUCKETS) * len(SIZE_CLASSES) * len(PLACES)
    if not isinstance(rows, list) or len(rows) > most:
        raise TuningFileError(f"{where}: 'entries' is not a list of at most {most} rows)")
    choices, times = {}, {}
    for row in rows:
        if not isinstance(row, dict):
            raise TuningFileError(f"{where}: an entry is not an object)")
        cls, nbytes, algorithm = row.get("class"), row.get("bytes"), row.get("algorithm")
        place = row.get("place")
        if type(cls) is not int or cls not in SIZE_CLASSES or type(nbytes) is not int or \
                nbytes not in BUCKETS or place not in PLACES:
            raise TuningFileError(f"{where}: entry class={cls!r} bytes={nbytes!r} "
                                  f"place={place!r} is not one of classes {SIZE_CLASSES}, "
                                  f"buckets {BUCKETS} and places {PLACES})")
        if algorithm not in CANDIDATES:
            raise TuningFileError(f"{where}: algorithm {algorithm!r} is not one of "
                                  f"{CANDIDATES})")
        measured = row.get("times", {})
        if not isinstance(measured, dict) or not all(
                n in CANDIDATES and type(t) in (int, float) and math.isfinite(t)
                for n, t in measured.items()):
            raise TuningFileError(f"{where}: bad times at {nbytes} B)")
        if (cls, nbytes, place) in choices:
            raise TuningFileError(f"{where}: entry class={cls} bytes={nbytes} place={place} "
                                  f"appears twice)")
        choices[(cls, nbytes, place)] = algorithm
        times[(cls, nbytes, place)] = {n: float(t) for n, t in measured.items()}
    seconds = entry.get("calibration_seconds", 0.0)
    return TuningTable(dict(entry["key"]), choices, f"file {path}", times,
                       float(seconds) if type(seconds) in (int, float) else 0.0)


def _read_regular(path: str) -> bytes:
    """The bytes of ``path``: a regular file of at most ``MAX_FILE_BYTES`` (a FIFO never holds
    the job, a device is refused: ``safe_files.read_regular``)."""
    try:
        return read_regular(path, MAX_FILE_BYTES)
    except UnreadableFile as err:
        raise TuningFileError(f"{path}: corrupt (it {err}; a tuning file is a JSON file)") \
            from None


def load_table(path: str, key: Mapping) -> TuningTable:
    """Read and validate the table for ``key`` from ``path`` (``TuningFileError``/``OSError``)."""
    raw = _read_regular(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TuningFileError(f"{path}: corrupt (not UTF-8 text)") from None
    return parse_file(text, key, path)


def save_table(path: str, table: TuningTable) -> None:
    """Write ``table`` into ``path``, keeping the file's valid tables of other keys; the
    file is replaced atomically (a reader sees the old or the new one)."""
    others: Sequence[Dict] = []
    mode = None   # (a new file keeps mkstemp's 0600; an existing one its own mode)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise TuningFileError(f"{path}: not a regular file; the tuning file is not written "
                              f"over it (name a file in a directory)")
    if info is not None:
        mode = stat.S_IMODE(info.st_mode)   # the file keeps its mode (a shared 0644 file)
    try:
        doc = json.loads(_read_regular(path).decode("utf-8"))
        if isinstance(doc, dict) and doc.get("format") == FORMAT and \
                doc.get("version") == VERSION and doc.get("buckets") == list(BUCKETS) and \
                isinstance(doc.get("tables"), list):
            others = [t for t in doc["tables"] if isinstance(t, dict) and
                      isinstance(t.get("key"), dict) and t["key"] != table.key]
    except (OSError, ValueError, RecursionError):   # (TuningFileError is a ValueError)
        pass
    doc = {"format": FORMAT, "version": VERSION, "buckets": list(BUCKETS),
           "tables": list(others) + [table.to_json()]}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tuning-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            if mode is not None:
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
