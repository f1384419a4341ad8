"""The text state file ``checkpoint`` that names the latest checkpoints (TensorFlow's format).

    model_checkpoint_path: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-1"
    all_model_checkpoint_paths: "ckpt-2"
    all_model_checkpoint_timestamps: 1764500000.5
    all_model_checkpoint_timestamps: 1764500100.25
    last_preserved_timestamp: 1764499000.0

Paths are relative to the directory. It is written atomically (temporary
file of a random name created with ``O_EXCL|O_NOFOLLOW``, fsync, rename, fsync of the
directory) and parsed without evaluating
anything::

    >>> from mpistrat.checkpoint.state_file import CheckpointState, format_state, parse_state
    >>> state = CheckpointState("ckpt-2", ["ckpt-1", "ckpt-2"], [1.0, 2.0], 0.5)
    >>> parse_state(format_state(state)) == state
    True
"""

import json
import math
import os
import stat
import re
from dataclasses import dataclass, field
from typing import List, Optional

from mpistrat.checkpoint.files import random_temp
from mpistrat.safe_files import replace_atomically
from mpistrat.errors import DataLossError

__all__ = ["CheckpointState", "format_state", "parse_state", "read_state", "write_state",
           "STATE_FILE"]

STATE_FILE = "checkpoint"
MAX_STATE_BYTES = 1 << 20
_LINE = re.compile(r'^\s*([a-z_]+)\s*:\s*(.+?)\s*$')


@dataclass
class CheckpointState:
    """What the state file says: the latest path, all kept paths and their times."""

    model_checkpoint_path: str
    all_model_checkpoint_paths: List[str] = field(default_factory=list)
    all_model_checkpoint_timestamps: List[float] = field(default_factory=list)
    last_preserved_timestamp: float = 0.0


def format_state(state: CheckpointState) -> str:
    """The text of the state file."""
    lines = [f"model_checkpoint_path: {json.dumps(state.model_checkpoint_path)}"]
    lines += [f"all_model_checkpoint_paths: {json.dumps(p)}" for p in state.all_model_checkpoint_paths]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in state.all_model_checkpoint_timestamps]
    lines.append(f"last_preserved_timestamp: {state.last_preserved_timestamp!r}")
    return "\n".join(lines) + "\n"


def parse_state(text: str) -> CheckpointState:
    """Parse the state file; ``ValueError`` on a line it does not understand."""
    state = CheckpointState("")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if not match:
            raise ValueError(f"line {number} of the checkpoint state file is malformed: {line!r}")
        key, raw = match.groups()
        if key == "model_checkpoint_path":
            state.model_checkpoint_path = _string(raw, number)
        elif key == "all_model_checkpoint_paths":
            state.all_model_checkpoint_paths.append(_string(raw, number))
        elif key == "all_model_checkpoint_timestamps":
            state.all_model_checkpoint_timestamps.append(_time(raw, number))
        elif key == "last_preserved_timestamp":
            state.last_preserved_timestamp = _time(raw, number)
    return state


def _time(raw: str, number: int) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"line {number} of the checkpoint state file: {raw!r} is not a "
                         f"time") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"line {number} of the checkpoint state file: time {raw} is not a "
                         f"finite, non-negative number")
    return value


def _string(raw: str, number: int) -> str:
    if not (raw.startswith('"') and raw.endswith('"')):
        raise ValueError(f"line {number} of the checkpoint state file: expected a quoted path")
    value = json.loads(raw)
    if not isinstance(value, str):
        raise ValueError(f"line {number} of the checkpoint state file: expected a string")
    return value


def read_state(directory: str) -> Optional[CheckpointState]:
    """The state in ``directory``, or ``None`` when there is no state file.

    A state file that is too large, not text, or malformed raises
    ``DataLossError`` naming it (what to do: delete or repair it).
    """
    path = os.path.join(directory, STATE_FILE)
    try:  # non-blocking: a FIFO planted under the name must not hang every rank
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise DataLossError(f"checkpoint state file {path} cannot be read: {err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataLossError(f"checkpoint state file {path} is not a regular file")
        data = os.read(fd, MAX_STATE_BYTES + 1)
    except OSError as err:
        raise DataLossError(f"checkpoint state file {path} cannot be read: {err}") from None
    finally:
        os.close(fd)
    try:
        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"it is larger than {MAX_STATE_BYTES} bytes")
        return parse_state(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise DataLossError(f"checkpoint state file {path} is damaged or not a state file "
                            f"({err}); delete it or restore it from a backup") from None


def write_state(directory: str, state: CheckpointState) -> None:
    """Replace the state file atomically (nothing is left behind if it fails)."""
    path = os.path.join(directory, STATE_FILE)
    text = format_state(state).encode("utf-8")
    replace_atomically(path, lambda handle: handle.write(text),
                       random_temp(directory, STATE_FILE))  # never follows a planted name
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
