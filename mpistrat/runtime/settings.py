"""Every ``MPISTRAT_*`` environment variable, parsed in one place.

Each variable is registered here once: its type (seconds, a byte count, a
boolean from an explicit set of spellings, a choice, ...), its default and
what it does. ``get(name)`` returns the parsed value; a value that does not
parse raises ``SettingError`` (a ``ValueError``) naming the variable, the
value and what is accepted. ``docs/settings.md`` lists them all::

    >>> from mpistrat.runtime import settings
    >>> settings.get("MPISTRAT_BUFFER_POOL_BYTES", {"MPISTRAT_BUFFER_POOL_BYTES": "64MiB"})
    67108864
    >>> settings.get("MPISTRAT_VALIDATE", {"MPISTRAT_VALIDATE": "maybe"})
    Traceback (most recent call last):
    ...
    mpistrat.runtime.settings.SettingError: MPISTRAT_VALIDATE='maybe': expected a boolean: 1, true, yes, on or 0, false, no, off (any case); unset means on (docs/settings.md lists every variable)

A bad value on one rank only must not leave the other ranks waiting: in a
job of several ranks, values read while ``mpistrat`` is imported
(``get(name, at_import=True)``) do not raise there; every variable of every
rank is checked when the library's world is made (its first collective,
``agree``), and then every rank raises the same error, naming the ranks.

Some variables are *per rank* on purpose (``per_rank``: each rank may set
its own value, or none), yet what a rank does with one depends on whether the
others set it too (``MPISTRAT_TIMELINE``: a merged trace needs every rank).
``agree`` also tells every rank which ranks set each of them, so that no rank
has to ask the others later (at exit, say, where a collective that only some
ranks join never ends)::

    >>> settings.per_rank_set({"MPISTRAT_TIMELINE": "/tmp/trace.json"})
    {'MPISTRAT_TIMELINE': True}
"""

import difflib
import math
import os
import re
import socket
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from mpistrat.errors import InvalidArgumentError

__all__ = ["Setting", "SettingError", "SETTINGS", "get", "problems", "unknown_names",
           "uniform_values", "disagreements", "per_rank_set", "ranks_that_set",
           "agree", "is_set", "parse_seconds", "parse_bytes", "parse_bool", "REMOVED"]


class SettingError(InvalidArgumentError):
    """An ``MPISTRAT_*`` variable holds a value that is not accepted (a ``ValueError``)."""


# -- parsers: pure functions of the text; each raises ValueError when it refuses -------------
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTES = re.compile(r"(-?\d+)\s*([a-z]*)")


def parse_seconds(text: str) -> float:
    """A finite number of seconds above 0.

    >>> parse_seconds("2.5")
    2.5
    """
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


def _orphan_seconds(text: str) -> int:
    """scripts/mpirun's reading: a decimal number of seconds, rounded up; 0 turns it off."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text.strip()):
        raise ValueError(text)
    return math.ceil(float(text))


def parse_bytes(text: str) -> int:
    """A byte count of at least 0, with an optional unit (KiB, MiB, GiB, TiB; KB, MB, GB, TB).

    >>> parse_bytes("64KiB"), parse_bytes("1MB"), parse_bytes("0")
    (65536, 1000000, 0)
    """
    match = _BYTES.fullmatch(text.strip().lower())
    if not match or match.group(2) not in _UNITS or int(match.group(1)) < 0:
        raise ValueError(text)
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_bool(text: str) -> bool:
    """``1, true, yes, on`` or ``0, false, no, off``, in any case.

    >>> parse_bool("Yes"), parse_bool("off")
    (True, False)
    """
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(text)


def _int_from(lowest: int) -> Callable[[str], int]:
    """The parser of an integer of at least ``lowest``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise ValueError(text)
        return value
    return parse


_positive_int, _nonnegative_int = _int_from(1), _int_from(0)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in options:
            raise ValueError(text)
        return lowered
    return parse


def _text(text: str) -> str:
    if any(c.isspace() for c in text.strip()) or not text.strip():
        raise ValueError(text)
    return text.strip()


def _path(text: str) -> str:
    if "\0" in text or not text.strip():
        raise ValueError(text)
    return text.strip()


def _host_port(text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or any(c.isspace() for c in host) or not 0 < int(port) < 65536:
        raise ValueError(text)
    return text.strip()


def _fault(text: str) -> tuple:
    parts = text.strip().split(":")
    how = parts.pop().upper() if parts[-1].upper() in ("KILL", "STOP") else "KILL"
    point, rank, count = ":".join(parts[:-2]), parts[-2], parts[-1]
    if not point or int(rank) < 0 or int(count) < 1:
        raise ValueError(text)
    return point, int(rank), int(count), how


# -- the registry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One variable: how to parse it, its default, what it accepts and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    effect: str
    for_tests: bool = False   # read by tests and scripts, not by the library
    # every rank must have the same value (it steers which MPI calls run); a function: the
    # same value of it (what of the value steers them)
    uniform: Any = False
    # each rank may set its own value (or none), and whether the others set it matters:
    # ``agree`` returns which ranks set it (never an error when they differ)
    per_rank: bool = False


_BOOL = "a boolean: 1, true, yes, on or 0, false, no, off (any case)"
_SECONDS = "a number of seconds above 0 and finite (e.g. 600 or 2.5)"
_BYTE_COUNT = "a byte count >= 0, optionally with a unit (e.g. 1048576, 64KiB, 1GiB, 100MB)"

SETTINGS = (
    Setting("MPISTRAT_COLLECTIVE_TIMEOUT", parse_seconds, None,
            _SECONDS + "; unset means no timeout",
            "default `timeout_seconds` of every collective; past it the waiting ranks raise "
            "`DeadlineExceededError`",
            uniform=lambda v: "a timeout" if v is not None else "no timeout"),
    Setting("MPISTRAT_HEALTH_CHECK", parse_bool, True, _BOOL + "; unset means on",
            "the peer health check: a rank that dies, leaves or becomes unreachable while "
            "others wait ends the job with a named error (docs/troubleshooting.md)", uniform=True),
    Setting("MPISTRAT_HEALTH_TIMEOUT", parse_seconds, 10.0, _SECONDS + "; unset means 10",
            "a peer whose host has not answered TCP keepalives for this long is unreachable: "
            "the job ends"),
    Setting("MPISTRAT_HEALTH_LEAVE_GRACE", parse_seconds, 3.0, _SECONDS + "; unset means 3",
            "how long a rank may stay inside a collective after a peer left the job normally "
            "before the job ends"),
    Setting("MPISTRAT_VALIDATE", parse_bool, True, _BOOL + "; unset means on",
            "the cross-rank check of op, dtypes, shapes and path before each collective",
            uniform=True),
    Setting("MPISTRAT_DETERMINISTIC", parse_bool, False, _BOOL + "; unset means off",
            "reproducible SUM and MEAN for every engine (as "
            "`CommunicationOptions(deterministic=True)`)", uniform=True),
    Setting("MPISTRAT_TUNING", _choice("auto", "on", "off"), "auto",
            "auto, on or off; unset means auto",
            "measured all-reduce choices (collectives/calibration.py): auto with a tuning file "
            "only, on always, off never"),
    Setting("MPISTRAT_TUNING_FILE", _path, None, "a file path; unset means none",
            "the tuning table cache: read when it holds this job's key, else calibrated and "
            "written (python -m mpistrat tune writes it ahead of a job)"),
    Setting("MPISTRAT_TUNING_BUDGET", parse_seconds, 2.0, _SECONDS + "; unset means 2",
            "the most seconds one calibration spends (it stops before a bucket that would "
            "not fit)"),
    Setting("MPISTRAT_TUNING_REFINE", _nonnegative_int, 64, "an integer >= 0; 0 turns it off; "
            "unset means 64",
            "real all-reduces per algorithm tried when refining a tuning table online "
            "(collectives/refinement.py)"),
    Setting("MPISTRAT_BUFFER_POOL_BYTES", parse_bytes, None,
            _BYTE_COUNT + "; 0 keeps none; unset means 1/32 of the machine's memory, at most "
            "1GiB",
            "freed memory kept for the next allocation: the collectives' scratch pool, and "
            "with glibc the allocator's mmap and trim thresholds (fresh results then reuse "
            "warm pages)"),
    Setting("MPISTRAT_TRACE", parse_bool, False, _BOOL + "; unset means off",
            "one line per collective on stderr, tagged with the rank"),
    Setting("MPISTRAT_TIMELINE", _path, None, "a file path; unset means off",
            "record every collective, checkpoint and dataset step; at exit rank 0 writes one "
            "Chrome trace of every rank there when every rank sets it, else each rank that "
            "sets it writes its own PATH.rank<r>.json (no collective)", per_rank=True),
    Setting("MPISTRAT_ABORT_ON_ERROR", parse_bool, True, _BOOL + "; unset means on",
            "an uncaught exception on any rank prints its traceback and ends the whole job"),
    Setting("MPISTRAT_RANKS_PER_NODE", _positive_int, None,
            "an integer >= 1; unset means the real nodes",
            "group consecutive ranks into simulated nodes of this many ranks", uniform=True),
    Setting("MPISTRAT_CUDA_AWARE_MPI", parse_bool, None, _BOOL + "; unset means ask Open MPI",
            "override the CUDA-awareness query (`MPIX_Query_cuda_support`)"),
    Setting("MPISTRAT_NCCL", parse_bool, None, _BOOL + "; unset means use NCCL when it imports",
            "off: never use NCCL (device arrays are staged or go to a CUDA-aware MPI)"),
    Setting("MPISTRAT_DISABLE_GPU", parse_bool, False, _BOOL + "; unset means off",
            "see no GPU: host replicas even on a GPU machine", uniform=True),
    Setting("MPISTRAT_CHECKPOINT_MODE", _choice("parallel", "parts"), "parallel",
            "parallel or parts; unset means parallel",
            "parts: one part file per rank plus a virtual-dataset master (for file systems "
            "where several writers to one file are unsafe, e.g. NFS)", uniform=True),
    Setting("MPISTRAT_CHECKPOINT_PREFLIGHT", parse_bool, True, _BOOL + "; unset means on",
            "off: skip the free-space check before a save (quota'd file systems; the file "
            "size limit is always checked)"),
    Setting("MPISTRAT_COORDINATOR_HOST", _text, None, "a host name or address; unset means "
            "127.0.0.1 on one node, else rank 0's host name",
            "the address other ranks use to reach rank 0 (JAX's coordinator)"),
    Setting("MPISTRAT_JAX_COORDINATOR", _host_port, None,
            "host:port; unset means a free port on rank 0",
            "JAX's coordinator address, in full"),
    Setting("MPISTRAT_JAX_INIT_TIMEOUT", parse_seconds, 120.0, _SECONDS + "; unset means 120",
            "seconds JAX's runtime may take to start on every host"),
    Setting("MPISTRAT_TEST_FAULT", _fault, None, "POINT:RANK:N[:KILL|STOP] (RANK >= 0, N >= 1)",
            "tests only: rank RANK kills (SIGKILL, the default) or stops (SIGSTOP) itself the "
            "N-th time it passes POINT"),
    Setting("MPISTRAT_TEST_ARRAYS", _choice("numpy", "jax", "cupy"), "numpy",
            "numpy, jax or cupy; unset means numpy",
            "tests/mpi builds its replica values, variables and expected results with this "
            "array module", for_tests=True),
    Setting("MPISTRAT_TEST_DEVICES_PER_HOST", _positive_int, 4, "an integer >= 1",
            "JAX CPU devices per rank that tests/tpu expect (XLA_FLAGS sets them)", for_tests=True),
    Setting("MPISTRAT_REPRO_DIR", _path, None, "a directory", "tests/mpi/test_reproducible.py "
            "writes the digest of a deterministic sum there", for_tests=True),
    Setting("MPISTRAT_TEST_LOGS", _path, None, "a directory", "tests/cluster keeps the rank-0 "
            "logs of the suites it runs across hosts there", for_tests=True),
    Setting("MPISTRAT_TEST_TF_PYTHON", _path, "/work/tfvenv/bin/python", "a Python executable",
            "a Python with TensorFlow that the convert tests and benchmarks/tfrecord.py compare "
            "against (skipped where it is missing)", for_tests=True),
    Setting("MPISTRAT_CLUSTER_DIR", _path, "/run/mpistrat-cluster", "a directory",
            "state of the namespace cluster (scripts/cluster)", for_tests=True),
    Setting("MPISTRAT_MPIRUN_LIMIT", parse_seconds, 600.0, _SECONDS,
            "default time limit of scripts/mpirun", for_tests=True),
    Setting("MPISTRAT_MPIRUN_ORPHAN_SECONDS", _orphan_seconds, 8, "whole seconds, 0: off",
            "scripts/mpirun kills an Open MPI mpirun that outlives all of its ranks this long, "
            "writing nothing (a fraction counts as the next whole second)", for_tests=True),
    Setting("MPISTRAT_SITE", _path, "slurm/site.sh", "a file",
            "the site file every slurm/ template sources (modules, VENV/PYTHON, SRUN_MPI)",
            for_tests=True),
    Setting("MPISTRAT_MPI", _choice("openmpi", "mpich"), "openmpi", "openmpi or mpich",
            "the MPI whose launcher scripts/mpirun runs (mpirun.openmpi or mpiexec.mpich)",
            for_tests=True),
    Setting("MPISTRAT_BENCH_LAUNCH", _path, None, "a launch command",
            "how scripts/bench.sh starts the multi-host benchmark (e.g. the cluster's mpirun)",
            for_tests=True),
    Setting("MPISTRAT_PYTEST_LIB", _path, None, "a site-packages directory",
            "where scripts/gpu_check.sh takes pytest from when the GPU machine's Python lacks it",
            for_tests=True),
)
_BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
# Variables no longer read, and what to use instead (a warning names them when set).
REMOVED = {
    "MPISTRAT_RING_THRESHOLD": "the all-reduce algorithm comes from the rules, the tuning table "
    "(MPISTRAT_TUNING, docs/tuning.md) or CommunicationOptions(algorithm=...)",
    "MPISTRAT_HIERARCHICAL_THRESHOLD": "the all-reduce algorithm comes from the rules, the "
    "tuning table (MPISTRAT_TUNING, docs/tuning.md) or CommunicationOptions(algorithm=...)",
}
_SEE = " (docs/settings.md lists every variable)"
_state = {"agreed": False}


def _raw(name: str, environ: Optional[Mapping[str, str]]) -> Optional[str]:
    text = (os.environ if environ is None else environ).get(name)
    return None if text is None or not text.strip() else text


def _refusal(setting: Setting, text: str) -> str:
    return f"{setting.name}={text!r}: expected {setting.accepted}"


def _parse(setting: Setting, text: str):
    try:
        return setting.parse(text)
    except (ValueError, TypeError, OverflowError):
        raise SettingError(_refusal(setting, text) + _SEE) from None


def get(name: str, environ: Optional[Mapping[str, str]] = None, at_import: bool = False):
    """The parsed value of variable ``name`` (its default when unset or empty).

    ``at_import=True`` marks a read made while mpistrat is imported: in a job of
    several ranks a bad value then gives the default here and is raised on every
    rank when the world is made (``agree``), so no rank fails alone while the
    others wait; in a single process it raises at once.
    """
    setting = _BY_NAME[name]
    text = _raw(name, environ)
    if text is None:
        return setting.default
    if at_import and environ is None and not _state["agreed"] and _world_size() > 1:
        try:
            return setting.parse(text)
        except (ValueError, TypeError, OverflowError):
            return setting.default   # agree() raises it on every rank
    return _parse(setting, text)


def is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether variable ``name`` is set (not empty): an override of a measured choice."""
    _BY_NAME[name]  # a KeyError for a name no setting knows
    return _raw(name, environ) is not None


def problems(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """What is wrong with every registered variable in ``environ``: one text each (pure)."""
    found = []
    for setting in SETTINGS:
        text = _raw(setting.name, environ)
        if text is not None:
            try:
                setting.parse(text)
            except (ValueError, TypeError, OverflowError):
                found.append(_refusal(setting, text))
    return found


def unknown_names(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """``MPISTRAT_*`` names in ``environ`` that no setting knows, with the closest known one."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(n for n in env if n.startswith("MPISTRAT_") and n not in _BY_NAME):
        if name in REMOVED:
            out.append(f"{name} (no longer read: {REMOVED[name]})")
            continue
        close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
        out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return out


def uniform_values(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The parsed values of the variables every rank must share (``uniform``: they steer
    which MPI calls a collective makes), where they parse (pure)."""
    values = {}
    for setting in SETTINGS:
        if setting.uniform:
            try:
                value = get(setting.name, environ)
            except SettingError:
                value = "(refused)"   # (problems() names it)
            values[setting.name] = setting.uniform(value) if callable(setting.uniform) and \
                value != "(refused)" else value
    return values


def per_rank_set(environ: Optional[Mapping[str, str]] = None) -> Dict[str, bool]:
    """Whether each ``per_rank`` variable is set (not empty) in ``environ`` (pure)."""
    return {s.name: _raw(s.name, environ) is not None for s in SETTINGS if s.per_rank}


def ranks_that_set(everyone: List[Dict[str, bool]]) -> Dict[str, Tuple[int, ...]]:
    """For each ``per_rank`` variable, the ranks that set it (pure; ``everyone[rank]`` is
    ``per_rank_set()``)::

        >>> ranks_that_set([{"MPISTRAT_TIMELINE": True}, {"MPISTRAT_TIMELINE": False}])
        {'MPISTRAT_TIMELINE': (0,)}
    """
    return {s.name: tuple(r for r, flags in enumerate(everyone) if flags.get(s.name))
            for s in SETTINGS if s.per_rank}


def disagreements(everyone: List[Dict[str, Any]]) -> List[str]:
    """For each ``uniform`` variable whose value differs between ranks, one text naming
    the ranks of each value (pure; ``everyone[rank]`` is ``uniform_values()``)::

        >>> disagreements([{"MPISTRAT_VALIDATE": True}, {"MPISTRAT_VALIDATE": False}])
        ['MPISTRAT_VALIDATE differs between ranks: rank 0 has True; rank 1 has False']
    """
    texts = []
    for name in everyone[0] if everyone else ():
        groups: Dict[str, List[int]] = {}
        for rank, values in enumerate(everyone):
            groups.setdefault(repr(values.get(name)), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"{'rank' if len(r) == 1 else 'ranks'} "
                              f"{', '.join(map(str, r))} {'has' if len(r) == 1 else 'have'} {v}"
                              for v, r in groups.items())
            texts.append(f"{name} differs between ranks: {parts}")
    return texts


def agree(comm) -> Dict[str, Tuple[int, ...]]:
    """Check every variable on every rank of ``comm`` (collective); raise the same
    ``SettingError`` on every rank when any rank has a bad value, naming the ranks, or when
    a ``uniform`` variable differs between ranks (ranks would pair different MPI calls and
    wait for ever).

    Returns, for each ``per_rank`` variable, the ranks of ``comm`` that set it
    (``ranks_that_set``): the same on every rank, learnt in the same ``allgather``."""
    mine = problems()
    if comm.Get_size() > 1:
        where = f"rank {comm.Get_rank()} ({socket.gethostname()})"
        everyone = comm.allgather((where, mine, uniform_values(), per_rank_set()))
        reports = [(w, texts) for w, texts, _, _ in everyone if texts]
        if reports:
            raise SettingError("; ".join(f"on {w}: {'; '.join(texts)}"
                                         for w, texts in reports) + _SEE)
        differ = disagreements([values for _, _, values, _ in everyone])
        if differ:
            raise SettingError("; ".join(differ) + " (give every rank the same environment: "
                               "mpirun -x NAME, or export it before srun)" + _SEE)
        set_by = ranks_that_set([flags for _, _, _, flags in everyone])
    elif mine:
        raise SettingError("; ".join(mine) + _SEE)
    else:
        set_by = ranks_that_set([per_rank_set()])
    _state["agreed"] = True
    unknown = unknown_names()
    if unknown:
        warnings.warn(f"rank {comm.Get_rank()}: unknown mpistrat variables: "
                      f"{', '.join(unknown)}{_SEE}",
                      stacklevel=2)
    return set_by


def _world_size() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()
