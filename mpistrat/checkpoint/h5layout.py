"""HDF5 lays out a checkpoint file in a process of its own, so its failures cannot crash ours.

When HDF5's own writes fail (a full disk, a file size limit, a quota), closing
the file can crash the process with a segmentation fault inside HDF5. So the
one step where HDF5 writes (the layout: datasets, attributes, scalars) runs in
a short-lived child: ``python h5layout.py`` reads a JSON description on
standard input, writes the file, and prints each dataset's byte offset as
JSON. A crash or an error there becomes a named ``OSError`` in the caller (the
errno kept), and the caller's checked writes then fill in the data.

The child runs in its own session with the job's stop signals blocked
(``SIGTERM`` to every process of a rank, or to its process group, must not kill
it in the middle of a save: the preemption handler then saves and exits 75).

This file imports only the standard library, NumPy and h5py: the child never
starts MPI. ``create(spec)`` is the caller's side::

    fd = files.create_exclusive(path)
    offsets = create({"path": path, "userblock": 512, "marker": MARKER.hex(),
                      "attrs": {"mpistrat_format_version": [2, "int64"]},
                      "datasets": [{"name": "w", "shape": [5], "dtype": "<f8", "attrs": {}}]}, fd)
"""

import json
import os
import signal
import subprocess
import sys

__all__ = ["create"]


def create(spec: dict, fd: int) -> dict:
    """Run the layout described by ``spec`` in a child process; return ``{name: offset}``.

    ``fd`` is the file, open for reading and writing, created by the caller
    (``files.create_exclusive``): the child writes through it, never by name.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # finds NumPy and h5py
    done = _run_shielded([sys.executable, "-S", os.path.abspath(__file__)],
                         json.dumps(dict(spec, fd=fd)), env, fd)
    if done.returncode == 0:
        return {name: int(offset) for name, offset in json.loads(done.stdout).items()}
    reply = _last_json(done.stdout)
    if reply is not None:
        raise OSError(reply.get("errno") or 5, reply["error"])
    how = (f"HDF5 crashed with signal {signal.Signals(-done.returncode).name}"
           if done.returncode < 0 else f"the HDF5 layout process exited with {done.returncode}")
    tail = " ".join(done.stderr.strip().splitlines()[-2:])[-300:]
    raise OSError(5, f"{how} while laying out {spec['path']}" + (f": {tail}" if tail else ""))


# The job's own stop signals: the child must outlive them (it is short-lived and waited for;
# the preemption handler saves and exits once the save it is part of has finished).
_SHIELDED = {getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1",
                                                "SIGUSR2", "SIGQUIT") if hasattr(signal, name)}


def _run_shielded(argv, text: str, env, fd: int) -> subprocess.CompletedProcess:
    """Run the layout child immune to the job's signals: in a session of its own (a signal to
    the job's process group, as Slurm or a terminal send, misses it), and with those signals
    blocked, a mask it inherits across ``exec`` (one sent to each of the job's processes stays
    pending until it exits). The caller's mask is restored at once; a signal that arrived
    meanwhile is delivered to it then."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SHIELDED)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env,
                                 start_new_session=True, pass_fds=(fd,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    stdout, stderr = child.communicate(text)
    return subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "error" in value:
            return value
    return None


# -- the child ----------------------------------------------------------------------------
def _attr(value):
    import numpy as np
    data, dtype = value
    return data if dtype is None else np.array(data, dtype=dtype)


def _dcpl():
    import h5py
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def _layout(spec: dict) -> dict:
    """Create the file: contiguous datasets allocated and never filled, scalars written,
    virtual datasets mapping part files; return the byte offset of each allocated dataset."""
    import io
    import h5py
    import numpy as np
    offsets = {}
    target = io.FileIO(spec["fd"], "r+", closefd=False)  # created by the caller, never by name
    with h5py.File(target, "w", userblock_size=spec["userblock"]) as f:
        # the marker first: a file left by a save torn from here on is known to be ours
        os.pwrite(spec["fd"], bytes.fromhex(spec["marker"]), 0)
        for key, value in spec["attrs"].items():
            f.attrs[key] = _attr(value)
        for item in spec["datasets"]:
            shape, dtype = tuple(item["shape"]), np.dtype(item["dtype"])
            if item.get("sources"):  # part-file mode: a virtual dataset over the parts
                layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                for a, b, part_file, part_name in item["sources"]:
                    layout[a:b] = h5py.VirtualSource(part_file, part_name,
                                                     shape=(b - a,) + shape[1:])
                dset = f.create_virtual_dataset(item["name"], layout)
            else:
                dset = f.create_dataset(item["name"], shape=shape, dtype=dtype, dcpl=_dcpl())
                if item.get("scalar") is not None:  # HDF5 allocates scalars when written
                    dset[()] = np.frombuffer(bytes.fromhex(item["scalar"]), dtype=dtype)[0]
                elif int(np.prod(shape, dtype=object)) * dtype.itemsize:
                    offsets[item["name"]] = int(dset.id.get_offset())
            for key, value in item["attrs"].items():
                dset.attrs[key] = _attr(value)
    return offsets


def _main() -> int:
    spec = json.loads(sys.stdin.read())
    try:
        offsets = _layout(spec)
    except Exception as err:  # noqa: BLE001 - reported to the caller as JSON
        print(json.dumps({"error": f"{type(err).__name__}: {err}",
                          "errno": getattr(err, "errno", None)}))
        return 1
    print(json.dumps(offsets))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
