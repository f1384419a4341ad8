"""The checkpoint file: one HDF5 file, one dataset per value at its object path.

Each dataset carries attributes: ``mpistrat_kind`` (variable, array, int,
float, bool, state), ``mpistrat_partitions`` (row ranges, n x 2) and
``mpistrat_checksums`` (CRC-32 of each partition's bytes, C order). The file
carries ``mpistrat_format_version`` and the writers' world size. Any HDF5
tool reads it (``h5dump -A ckpt-1.h5``); loading never unpickles anything.

Two writers with one layout:

* ``parallel``: h5py with MPI: all ranks open the file with ``driver="mpio"``,
  create the datasets together, and each rank writes its own partitions.
* ``parts``: h5py without MPI (the GPU machine's image): each rank writes the
  partitions it owns into ``NAME.part-R-of-N.h5``; rank 0 writes the master
  ``NAME.h5`` whose datasets are HDF5 virtual datasets mapping those parts.

Both write under a temporary name, fsync, then rename: a reader never sees a
torn file. The caller (``commit.py``) decides when a checkpoint becomes the
latest one.
"""

import os
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Tuple

import h5py
import numpy as np
from mpi4py import MPI

from mpistrat.checkpoint.graph import check_path
from mpistrat.checkpoint.layout import partition_owner, read_runs, write_partitions
from mpistrat.collectives import CollectiveEngine
from mpistrat.errors import DataLossError, NotFoundError

__all__ = ["FORMAT_VERSION", "write_file", "read_file", "part_files", "parallel_available",
           "fault_point", "gather_errors"]

FORMAT_VERSION = 1
_SMALL_BYTES = 1 << 20  # values below this are read whole by every rank


def parallel_available() -> bool:
    """Whether h5py was built with MPI (``MPISTRAT_CHECKPOINT_MODE=parts`` forces part files)."""
    if os.environ.get("MPISTRAT_CHECKPOINT_MODE", "").lower() == "parts":
        return False
    return bool(h5py.get_config().mpi)


_FAULT_HITS: Dict[str, int] = {}


def fault_point(name: str, rank: int) -> None:
    """Test hook: ``MPISTRAT_FAULT=name:rank:n`` kills this rank with SIGKILL the n-th time here."""
    spec = os.environ.get("MPISTRAT_FAULT", "")
    if not spec.startswith(f"{name}:{rank}:"):
        return
    _FAULT_HITS[name] = _FAULT_HITS.get(name, 0) + 1
    if _FAULT_HITS[name] == int(spec.rsplit(":", 1)[1]):
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def part_files(final: str, size: int) -> List[str]:
    """The part files of a ``parts``-mode checkpoint written by ``size`` ranks."""
    stem = final[:-3] if final.endswith(".h5") else final
    return [f"{stem}.part-{r}-of-{size}.h5" for r in range(size)]


def _checksum(block: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(block).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def _rows(value: np.ndarray, a: int, b: int) -> np.ndarray:
    return value.reshape(1) if value.ndim == 0 else value[a:b]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable."""
    _fsync(directory or ".")


# -- writing ------------------------------------------------------------------------------
def write_file(final: str, values: Dict[str, np.ndarray], kinds: Dict[str, str],
               comm: MPI.Comm, engine: CollectiveEngine, parallel: bool) -> None:
    """Write ``values`` (the same on every rank) to ``final``, atomically. Collective."""
    rank, size = comm.Get_rank(), comm.Get_size()
    directory = os.path.dirname(final) or "."
    token = engine.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
    tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{token}")
    paths = sorted(values)
    layouts = {p: write_partitions(values[p].shape, values[p].dtype.itemsize, size) for p in paths}
    mine: Dict[Tuple[str, int], int] = {}
    error = None
    try:
        if parallel:
            _write_parallel(tmp, paths, values, kinds, layouts, comm, mine)
        else:
            _write_parts(final, paths, values, layouts, comm, mine)
    except Exception as err:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = f"rank {rank}: {type(err).__name__}: {err}"
    _agree_or_raise(engine, error, f"writing checkpoint {final}")
    checksums = {}
    for part in engine.comm.allgather(mine):  # small: one CRC per partition
        checksums.update(part)
    error = None
    if rank == 0:
        try:
            if parallel:
                _finish_parallel_attrs(tmp, paths, layouts, checksums)
            else:
                _write_master(tmp, final, paths, values, kinds, layouts, checksums, size)
            _fsync(tmp)
            os.replace(tmp, final)
            fsync_dir(directory)
        except Exception as err:  # noqa: BLE001
            error = f"rank 0: {type(err).__name__}: {err}"
    _agree_or_raise(engine, error, f"committing checkpoint {final}")


def gather_errors(engine: CollectiveEngine, error) -> List[str]:
    """Every rank's error text (``None`` where it went well): all ranks get the same list."""
    return [e for e in engine.comm.allgather(error) if e]


def _agree_or_raise(engine: CollectiveEngine, error, what: str) -> None:
    """Every rank raises the same error if any rank failed (no rank is left waiting)."""
    errors = gather_errors(engine, error)
    if errors:
        raise OSError(f"{what} failed: " + "; ".join(errors))


def _write_parallel(tmp, paths, values, kinds, layouts, comm, mine):
    rank, size = comm.Get_rank(), comm.Get_size()
    with h5py.File(tmp, "w", driver="mpio", comm=comm) as f:
        f.attrs["mpistrat_format_version"] = FORMAT_VERSION
        f.attrs["mpistrat_world_size"] = size
        datasets = []
        for p in paths:  # collective: every rank creates every dataset
            value = values[p]
            dset = f.create_dataset(p, shape=value.shape, dtype=value.dtype, fill_time="never")
            dset.attrs["mpistrat_kind"] = kinds[p]
            dset.attrs["mpistrat_partitions"] = np.array(layouts[p], dtype=np.int64)
            dset.attrs["mpistrat_checksums"] = np.zeros(len(layouts[p]), dtype=np.uint32)
            datasets.append(dset)
        for index, (p, dset) in enumerate(zip(paths, datasets)):  # independent writes
            for part, (a, b) in enumerate(layouts[p]):
                if partition_owner(index, part, size) != rank:
                    continue
                block = _rows(values[p], a, b)
                if values[p].ndim == 0:
                    dset[()] = values[p]
                else:
                    dset[a:b] = block
                mine[(p, part)] = _checksum(block)
                fault_point("checkpoint-partition-written", rank)
        f.flush()


def _finish_parallel_attrs(tmp, paths, layouts, checksums):
    with h5py.File(tmp, "r+") as f:  # rank 0 alone, after the collective close
        for p in paths:
            f[p].attrs["mpistrat_checksums"] = np.array(
                [checksums[(p, k)] for k in range(len(layouts[p]))], dtype=np.uint32)


def _write_parts(final, paths, values, layouts, comm, mine):
    rank, size = comm.Get_rank(), comm.Get_size()
    part_path = part_files(final, size)[rank]
    tmp = part_path + ".tmp"
    with h5py.File(tmp, "w") as f:
        for index, p in enumerate(paths):
            for part, (a, b) in enumerate(layouts[p]):
                if partition_owner(index, part, size) != rank:
                    continue
                block = _rows(values[p], a, b)
                f.create_dataset(f"{p}/part-{part}", data=block)
                mine[(p, part)] = _checksum(block)
                fault_point("checkpoint-partition-written", rank)
    _fsync(tmp)
    os.replace(tmp, part_path)


def _write_master(tmp, final, paths, values, kinds, layouts, checksums, size):
    parts = [os.path.basename(name) for name in part_files(final, size)]
    with h5py.File(tmp, "w") as f:
        f.attrs["mpistrat_format_version"] = FORMAT_VERSION
        f.attrs["mpistrat_world_size"] = size
        for index, p in enumerate(paths):
            value = values[p]
            if value.ndim == 0:  # a scalar: stored in the master itself
                dset = f.create_dataset(p, data=value)
            else:
                layout = h5py.VirtualLayout(shape=value.shape, dtype=value.dtype)
                for part, (a, b) in enumerate(layouts[p]):
                    owner = partition_owner(index, part, size)
                    layout[a:b] = h5py.VirtualSource(parts[owner], f"{p}/part-{part}",
                                                     shape=(b - a,) + value.shape[1:])
                dset = f.create_virtual_dataset(p, layout)
            dset.attrs["mpistrat_kind"] = kinds[p]
            dset.attrs["mpistrat_partitions"] = np.array(layouts[p], dtype=np.int64)
            dset.attrs["mpistrat_checksums"] = np.array(
                [checksums[(p, k)] for k in range(len(layouts[p]))], dtype=np.uint32)


# -- reading ------------------------------------------------------------------------------
def read_file(final: str, engine: CollectiveEngine) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Every value of ``final`` on every rank, checksums verified. Collective.

    Small values are read whole by each rank; large ones in contiguous runs
    of partitions, one run per rank, then gathered. Any failure raises the
    same error on every rank, naming the file, the object path and the rank.
    """
    rank, size = engine.rank, engine.size
    if not os.path.exists(final):
        raise NotFoundError(f"checkpoint file {final} does not exist")
    pieces: Dict[str, np.ndarray] = {}
    meta: Dict[str, Tuple[tuple, np.dtype, str]] = {}
    error = None
    # CRCs run in worker threads (zlib releases the GIL) while the next dataset is read.
    checks: List[Future] = []
    try:
        with ThreadPoolExecutor(max_workers=2) as pool, h5py.File(final, "r") as f:
            if f.attrs.get("mpistrat_format_version") != FORMAT_VERSION:
                raise DataLossError(f"{final} is not an mpistrat checkpoint of format version "
                                    f"{FORMAT_VERSION} (found {f.attrs.get('mpistrat_format_version')!r})")
            for p in _dataset_paths(f):
                dset = f[p]
                kind = str(dset.attrs["mpistrat_kind"])
                partitions = [tuple(int(x) for x in row) for row in dset.attrs["mpistrat_partitions"]]
                sums = [int(x) for x in dset.attrs["mpistrat_checksums"]]
                meta[p] = (dset.shape, dset.dtype, kind)
                if dset.size * dset.dtype.itemsize < _SMALL_BYTES or dset.ndim == 0:
                    run = (0, len(partitions))
                else:
                    run = read_runs(len(partitions), size)[rank]
                pieces[p] = _read_run(final, p, dset, partitions[run[0]:run[1]],
                                      sums[run[0]:run[1]], pool, checks)
            for check in checks:
                check.result()  # raises the DataLossError of a failed checksum
    except (DataLossError, NotFoundError) as err:
        error = f"{type(err).__name__}|rank {rank}: {err}"
    except Exception as err:  # noqa: BLE001 - h5py raises OSError/KeyError on damaged files
        error = (f"DataLossError|rank {rank}: {final} could not be read as an mpistrat "
                 f"checkpoint ({type(err).__name__}: {err})")
    errors = gather_errors(engine, error)
    if errors:
        kind, _, _ = errors[0].partition("|")
        text = "; ".join(e.partition("|")[2] for e in errors)
        raise (NotFoundError if kind == "NotFoundError" else DataLossError)(text)
    return _assemble(pieces, meta, engine), {p: m[2] for p, m in meta.items()}


def _dataset_paths(f: h5py.File) -> List[str]:
    names: List[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    for name in names:
        try:
            check_path(name)
        except ValueError as err:
            raise DataLossError(f"{f.filename}: dataset {name!r}: {err}") from None
    return sorted(names)


def _read_run(final, path, dset, partitions, sums, pool, checks) -> np.ndarray:
    """Read a run of partitions; ``pool`` verifies their checksums (futures into ``checks``)."""
    if dset.ndim == 0:
        blocks = [np.asarray(dset[()]).reshape(1)]
    elif not partitions:
        return np.empty((0,) + dset.shape[1:], dtype=dset.dtype)
    else:
        whole = dset[partitions[0][0]:partitions[-1][1]]
        start = partitions[0][0]
        blocks = [whole[a - start:b - start] for a, b in partitions]
    for (a, b), block, expected in zip(partitions, blocks, sums):
        checks.append(pool.submit(_verify, block, expected, final, path, a, b))
    if dset.ndim == 0:
        return blocks[0].reshape(())
    return whole


def _verify(block, expected, final, path, a, b) -> None:
    if _checksum(block) != expected:
        raise DataLossError(f"checksum mismatch in {final}, object {path!r}, rows {a}:{b}: "
                            f"the file is corrupt; restore an earlier checkpoint")


def _assemble(pieces, meta, engine) -> Dict[str, np.ndarray]:
    large = [p for p, (shape, dtype, _) in meta.items()
             if len(shape) and int(np.prod(shape)) * dtype.itemsize >= _SMALL_BYTES]
    values = {p: v for p, v in pieces.items() if p not in large}
    if large and engine.size == 1:  # this rank read every partition itself
        values.update((p, pieces[p]) for p in large)
    elif large:
        gathered = engine.all_gather([pieces[p] for p in large], axis=0)
        values.update(zip(large, gathered))
    return values
