"""Names of checkpoint files, and the clean-up of what torn saves left behind.

A checkpoint ``dir/ckpt-3`` is the file ``dir/ckpt-3.h5`` (plus, in part-file
mode, ``dir/ckpt-3.part-R-of-N.h5``). Temporary files are ``.NAME.tmp-TOKEN``.

    >>> from mpistrat.checkpoint.files import data_file
    >>> data_file("/tmp/run/ckpt-3")
    '/tmp/run/ckpt-3.h5'
"""

import glob
import os
import re
from typing import List

from mpistrat.errors import NotFoundError

__all__ = ["data_file", "resolve", "remove_checkpoint", "remove_leftovers"]

_PART = re.compile(r"^(?P<stem>.+)\.part-\d+-of-\d+\.h5(\.tmp)?$")


def data_file(prefix: str) -> str:
    """The HDF5 file of checkpoint ``prefix``."""
    return prefix if prefix.endswith(".h5") else prefix + ".h5"


def resolve(save_path: str) -> str:
    """The existing file for ``save_path``, or ``NotFoundError`` with a hint."""
    path = os.fspath(save_path)
    if os.path.isfile(data_file(path)):
        return data_file(path)
    hint = ""
    if not re.search(r"-\d+(\.h5)?$", path):
        siblings = sorted(glob.glob(glob.escape(path) + "-*.h5"))
        hint = ("; checkpoints written by save() carry a '-N' suffix"
                + (f", e.g. {siblings[-1][:-3]}" if siblings else ""))
    raise NotFoundError(f"no checkpoint at {path} (looked for {data_file(path)}){hint}")


def remove_checkpoint(prefix: str) -> None:
    """Delete a checkpoint's file and any part files."""
    final = data_file(prefix)
    for path in [final] + glob.glob(glob.escape(final[:-3]) + ".part-*-of-*.h5"):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def remove_leftovers(directory: str) -> List[str]:
    """Delete temporary files and orphaned part files of torn saves; return their names."""
    removed = []
    try:
        names = os.listdir(directory or ".")
    except FileNotFoundError:
        return removed
    for name in names:
        match = _PART.match(name)
        orphan = match and (name.endswith(".tmp") or
                            not os.path.exists(os.path.join(directory, match["stem"] + ".h5")))
        if (name.startswith(".") and ".tmp-" in name) or orphan:
            try:
                os.remove(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
