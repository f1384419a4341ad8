"""A checkpoint directory as every rank sees it: its state file, its latest checkpoint.

Every decision about the directory is taken by each rank and agreed
(``collectives.agreement``), so ranks that see different directories (node-local
storage) raise together, naming what each saw. Names from the state file are
confined to the directory (``files.state_name``): nothing outside it is read or
deleted.

    >>> import numpy as np, tempfile, mpistrat as ms
    >>> from mpistrat.checkpoint.directory import latest_checkpoint
    >>> run = tempfile.mkdtemp()
    >>> latest_checkpoint(run) is None
    True
    >>> path = ms.Checkpoint(w=ms.Variable(np.zeros(2))).save(run + "/ckpt")
    >>> latest_checkpoint(run) == path
    True
"""

import os
import time
import warnings
from typing import Dict, List, Optional, Tuple

from mpistrat.checkpoint import writer
from mpistrat.checkpoint.files import data_file, local_view, remove_leftovers, state_name
from mpistrat.checkpoint.same_path import agree_view_at
from mpistrat.checkpoint.state_file import STATE_FILE, CheckpointState, read_state, write_state
from mpistrat.collectives import CollectiveEngine, CommunicationOptions
from mpistrat.collectives.agreement import agree_view
from mpistrat.distribute.context import get_strategy, has_strategy
from mpistrat.distribute.strategy import newest_timeout
from mpistrat.errors import DataLossError, NotFoundError
from mpistrat.runtime import get_world
from mpistrat.tfformats.bundle import is_bundle

__all__ = ["io_engine", "prepare_directory", "read_kept", "record_latest", "agreed_state",
           "latest_checkpoint", "restore_target"]

_IO_COMM: list = []   # the checkpoints' own communicator, made once
_IO_ENGINES: Dict[Optional[float], CollectiveEngine] = {}


def io_engine() -> CollectiveEngine:
    """The checkpoint engine, on the checkpoints' own communicator (so async writes never
    meet training), under the strategy's timeout: ``timeout_seconds`` of the current
    strategy's ``CommunicationOptions`` (outside every scope, of the newest strategy the job
    made), else ``MPISTRAT_COLLECTIVE_TIMEOUT``. One engine per timeout, all on the one
    communicator (made at the first call: collective); a timeout in one makes them all
    refuse further calls, as one engine does."""
    if not _IO_COMM:
        _IO_COMM.append(get_world().new_comm("mpistrat-checkpoint"))
    timeout = strategy_timeout()
    engine = _IO_ENGINES.get(timeout)
    if engine is None:
        engine = _IO_ENGINES[timeout] = CollectiveEngine(
            _IO_COMM[0], CommunicationOptions(timeout_seconds=timeout))
    broken = next((e._broken for e in _IO_ENGINES.values() if e._broken), None)
    if broken and not engine._broken:
        engine._broken = broken   # (the communicator is out of step for every engine on it)
    return engine


def strategy_timeout() -> Optional[float]:
    """``timeout_seconds`` of the strategy a checkpoint works under (``None``: none given):
    the current scope's, else the newest strategy's (alike on every rank)."""
    if has_strategy():
        return get_strategy().extended.engine.options.timeout_seconds
    return newest_timeout()


def prepare_directory(directory: str, engine: CollectiveEngine, path: str) -> None:
    """Rank 0 creates ``directory`` and removes our leftovers; every rank must then see it."""
    with engine.agreed(f"saving checkpoint {path}", doing=f"preparing {directory}"):
        if engine.rank == 0:
            os.makedirs(directory, exist_ok=True)
            remove_leftovers(directory)  # best effort: warns about what it cannot delete
    agree_view_at(engine, path, local_view(directory), f"checkpoint directory {directory}",
                  f"saving checkpoint {path}")


def read_kept(directory: str) -> Tuple[Optional[str], List[Tuple[str, float]], float]:
    """This rank's reading of the state file: latest name, kept ``(name, time)``, preserved time.

    Names are validated (``files.state_name``): any that would lead outside the
    directory is ignored with a warning, never read or deleted; names whose
    file is missing are dropped.
    """
    state = read_state(directory)
    if state is None:
        return None, [], 0.0
    kept, refused = [], []
    times = state.all_model_checkpoint_timestamps
    for index, raw in enumerate(state.all_model_checkpoint_paths):
        name = state_name(directory, raw)
        if name is None:
            refused.append(raw)
        elif os.path.isfile(data_file(os.path.join(directory, name))):
            kept.append((name, times[index] if index < len(times) else 0.0))
    latest = state_name(directory, state.model_checkpoint_path) if state.model_checkpoint_path \
        else None
    if state.model_checkpoint_path and latest is None:
        refused.append(state.model_checkpoint_path)
    if latest is not None and not os.path.isfile(data_file(os.path.join(directory, latest))) \
            and not is_bundle(os.path.join(directory, latest)):  # ours, else TensorFlow's
        latest = None
    if refused:
        warnings.warn(f"the checkpoint state file in {directory} names paths outside the "
                      f"directory; ignored: {refused}", RuntimeWarning, stacklevel=3)
    return latest, kept, state.last_preserved_timestamp


def record_latest(path: str) -> None:
    """Name ``path`` as the latest checkpoint, keeping the others listed."""
    directory, name = os.path.split(path)
    directory = directory or "."
    _, kept, preserved = read_kept(directory)  # a file that is not a state file is refused
    times = dict(kept)
    times.pop(name, None)
    times[name] = time.time()
    write_state(directory, CheckpointState(name, list(times), list(times.values()), preserved))


def agreed_state(directory: str, engine: CollectiveEngine):
    """``read_kept(directory)`` as every rank sees it; ranks that see differently raise."""
    writer.wait_idle()
    try:
        view = ("ok",) + read_kept(directory)
    except DataLossError as err:
        view = ("error", str(err))
    agree_view_at(engine, directory, view, f"checkpoint directory {directory}",
                  f"checkpoint directory {directory}")
    if view[0] == "error":
        raise DataLossError(view[1])
    return view[1:]


def latest_checkpoint(checkpoint_dir: str, latest_filename: Optional[str] = None) -> Optional[str]:
    """The path of the newest complete checkpoint in ``checkpoint_dir``, or ``None``.

    Collective, like every checkpoint call: each rank reads the state file and
    the ranks agree, so ranks that see different directories (node-local
    storage) raise ``NotFoundError`` together, naming what each saw. It waits
    for an async save in flight first, so all ranks answer alike.
    """
    if latest_filename not in (None, STATE_FILE):
        raise ValueError(f"latest_filename={latest_filename!r}: only the default state file "
                         f"name {STATE_FILE!r} is supported")
    directory = os.fspath(checkpoint_dir)
    latest, _, _ = agreed_state(directory, io_engine())
    return os.path.join(directory, latest) if latest is not None else None


def restore_target(path: str) -> str:
    """The checkpoint a restore path names: a TensorFlow ``PREFIX.index`` names ``PREFIX``;
    a directory names its latest checkpoint (collective: ``latest_checkpoint``), or none
    (``NotFoundError``); any other path itself."""
    if path.endswith(".index") and is_bundle(path[:-len(".index")]):
        return path[:-len(".index")]
    if agree_view(io_engine(), os.path.isdir(path), f"whether {path} is a directory"):
        latest = latest_checkpoint(path)
        if latest is None:
            raise NotFoundError(f"no checkpoint in directory {path} (its state file "
                                f"'checkpoint' names none)")
        return latest
    return path
