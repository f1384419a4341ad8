"""``python -m mpistrat doctor``: is this site's set-up ready for mpistrat? One table, a fix
for each failure, exit status 0 only when every check passes.

Run it as a job would run, under the site's launcher::

    srun -N 2 --ntasks-per-node=2 python -m mpistrat doctor --dir /scratch/$USER/ckpt-check
    mpirun -n 3 python -m mpistrat doctor --json

Each check runs on every rank and the ranks' results are joined on rank 0: the MPI library
and whether this mpi4py speaks to the launcher that started it (a build for another MPI
starts every rank as a lone singleton), the ranks and nodes seen, one collective of each
kind with its values checked, CUDA-aware MPI and NCCL where there are GPUs, h5py, a
checkpoint written and read back bit for bit in the directory named (a directory that
some rank does not see, or cannot write, fails here rather than in the job), the Slurm
allocation and each rank's GPU binding. The checks themselves are pure functions of what
the ranks report (``judge_*``), so they are tested without MPI::

    >>> judge_launch({"size": 1, "launcher_size": 4, "mpi": "Open MPI v4.1.4"})[:2]
    ('fail', 'the launcher started 4 ranks but MPI sees 1: each rank is a singleton')
"""

import glob
import json
import os
import secrets
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mpistrat.runtime import launch_check
from mpistrat.runtime.libraries import FIX, linked_mpi, mpi_family

__all__ = ["doctor", "main", "judge_launch", "judge_layout", "judge_slurm", "judge_libraries",
           "judge_threads", "judge_arrays", "mpi_family", "linked_mpi", "render"]

Check = Tuple[str, str, str]          # (status: pass/fail/skip, what was found, the fix)
def _launcher_size() -> Optional[int]:
    """How many ranks the launcher says it started (its environment), when it says."""
    return launch_check.launched_size(os.environ, count_plain_srun=True)[0]


# -- the judgements (pure) ----------------------------------------------------------------
def judge_launch(fact: Dict) -> Check:
    """MPI is the launcher's: the ranks MPI sees are the ranks the launcher started."""
    launched = fact.get("launcher_size")
    if launched is not None and launched != fact["size"]:
        return ("fail", f"the launcher started {launched} ranks but MPI sees {fact['size']}: "
                        f"each rank is a singleton",
                "mpi4py was built for another MPI than the one that launched the job: "
                "rebuild it against the site's MPI (docs/install.md, step 3: "
                "MPICC=$(which mpicc) pip install --no-binary=mpi4py mpi4py), or launch "
                "with that MPI's own mpirun / the site's srun --mpi=...")
    return ("pass", f"{fact['mpi']}; {fact['size']} rank(s)", "")


def judge_libraries(fact: Dict) -> Check:
    """h5py's HDF5 is linked to the MPI that runs (one built for the other MPI, e.g. handed
    over by pip's cache, crashes inside libhdf5 when loaded beside it)::

        >>> judge_libraries({"running": "Open MPI", "h5py_mpi_lib": ("MPICH", "libmpich.so.12"),
        ...                  "mpi4py_mpi_lib": ("Open MPI", "libmpi.so.40")})[0]
        'fail'
    """
    running = fact["running"]
    wrong = [(package, found) for package, found in (("h5py", fact["h5py_mpi_lib"]),
                                                     ("mpi4py", fact["mpi4py_mpi_lib"]))
             if found[0] is not None and running is not None and found[0] != running]
    if wrong:
        names = "; ".join(f"{package} is linked to {found[0]} ({found[1]})"
                          for package, found in wrong)
        return ("fail", f"{names}, but this job runs {running}; not loaded", FIX)
    said = "; ".join(f"{package}: {found[1]}"
                     for package, found in (("mpi4py", fact["mpi4py_mpi_lib"]),
                                            ("h5py", fact["h5py_mpi_lib"])))
    return ("pass", f"{running or 'an MPI not named here'}; {said}", "")


def judge_threads(facts: Sequence[Dict]) -> Check:
    """No more ranks on a node than the cores they may run on (the union of their
    affinities), unless a thread count is set: otherwise each rank's BLAS/OpenMP takes
    every core (pure)::

        >>> judge_threads([{"host": "a", "cores": [0, 1], "threads_set": ""}] * 3)[0]
        'fail'
    """
    worst = None
    for fact in facts:
        mates = [f for f in facts if f["host"] == fact["host"]]
        cores = len(set().union(*(f["cores"] for f in mates)))   # (ranks may be bound)
        if len(mates) > cores and not fact["threads_set"]:
            worst = (fact["host"], len(mates), cores)
    if worst:
        host, ranks, cores = worst
        return ("fail", f"{host}: {ranks} ranks on {cores} cores with OMP_NUM_THREADS and the "
                        f"BLAS thread counts unset (each rank takes every core)",
                f"start at most {cores} ranks per node, or set OMP_NUM_THREADS=1 (and "
                f"OPENBLAS_NUM_THREADS/MKL_NUM_THREADS) for every rank")
    threads = sorted({f["threads_set"] or "unset" for f in facts})
    return ("pass", f"cores per rank fit; threads per rank: {', '.join(threads)}", "")


def judge_arrays(fact: Dict) -> Check:
    """The array library the job's replicas need (``--arrays``) imports."""
    kind, error = fact["arrays"], fact["arrays_error"]
    if kind == "numpy":
        return ("skip", "NumPy replicas (--arrays jax or cupy checks those)", "")
    if error:
        return ("fail", f"--arrays {kind}: {error}",
                f"install the extra in this environment: pip install 'mpistrat[{'jax' if kind == 'jax' else 'gpu'}]'")
    return ("pass", f"{kind} imports", "")


def judge_layout(facts: Sequence[Dict]) -> Check:
    """Ranks and nodes: every rank sees the same world, a node count, ranks per node."""
    hosts: Dict[str, List[int]] = {}
    for fact in facts:
        hosts.setdefault(fact["host"], []).append(fact["rank"])
    nodes = {fact["nodes"] for fact in facts}
    if len(nodes) != 1 or nodes.pop() != len(hosts):
        return ("fail", f"ranks disagree on the nodes: {sorted({f['nodes'] for f in facts})} "
                        f"node(s) for hosts {sorted(hosts)}",
                "the node split (MPI_COMM_TYPE_SHARED) does not follow the hosts: check the "
                "launcher's host list")
    per = sorted({len(r) for r in hosts.values()})
    return ("pass", f"{len(facts)} ranks on {len(hosts)} node(s), "
                    f"{'/'.join(map(str, per))} per node", "")


def judge_slurm(facts: Sequence[Dict]) -> Check:
    """Inside Slurm: the step's task count is the job's size."""
    first = facts[0]["slurm"]
    if not first:
        return ("skip", "not inside a Slurm allocation", "")
    tasks = first.get("SLURM_NTASKS")
    if tasks and tasks.isdigit() and int(tasks) != len(facts) and first.get("SLURM_STEP_ID"):
        return ("fail", f"SLURM_NTASKS={tasks} but the job has {len(facts)} ranks",
                "launch with srun -n N (or mpirun inside the allocation) so every task is a rank")
    return ("pass", ", ".join(f"{k[6:].lower()}={v}" for k, v in first.items()), "")


# -- the checks that run collectives and files ----------------------------------------------
def _collectives(strategy, world) -> Check:
    from mpistrat.collectives import CommunicationOptions
    options = CommunicationOptions(timeout_seconds=60)
    engine = strategy.extended.engine
    n, rank = world.size, world.rank
    total = engine.all_reduce([np.full(1000, rank + 1.0)], "SUM", options)[0]
    gathered = engine.all_gather([np.full((2, 3), rank, np.int32)], 0, options)[0]
    sent = engine.broadcast([np.arange(5.0) * (rank == 0)], 0, options)[0]
    wrong = []
    if not np.all(total == n * (n + 1) / 2):
        wrong.append("all_reduce")
    if not np.array_equal(gathered[:, 0], np.repeat(np.arange(n), 2)):
        wrong.append("all_gather")
    if not np.array_equal(sent, np.arange(5.0)):
        wrong.append("broadcast")
    if wrong:
        return ("fail", f"wrong values from {', '.join(wrong)}",
                "the MPI library returns wrong results: report it with `python -m mpistrat "
                "info --json` attached")
    return ("pass", "all_reduce, all_gather and broadcast: right values on every rank", "")


def _checkpoint(directory: str, world) -> Check:
    import mpistrat as ms
    token, existed = world.comm.bcast((secrets.token_hex(4), os.path.isdir(directory)), root=0)
    values = {"w": np.arange(world.size * 1000, dtype=np.float32) + 0.5,
              "step": np.int64(7)}
    prefix = os.path.join(directory, f"mpistrat-doctor-{token}")
    try:
        path = ms.Checkpoint(model=values).write(prefix)
        back = {"w": np.zeros_like(values["w"]), "step": np.int64(0)}
        ms.Checkpoint(model=back).read(path).assert_consumed()
        same = back["w"].tobytes() == values["w"].tobytes() and int(back["step"]) == 7
    except Exception as err:  # noqa: BLE001 - raised alike on every rank: reported, not raised
        return ("fail", f"{type(err).__name__}: {err}",
                "name a directory on a file system that every node mounts and you can write "
                "(--dir); where several writers to one file are unsafe (NFS), set "
                "MPISTRAT_CHECKPOINT_MODE=parts")
    finally:
        world.comm.Barrier()
        if world.rank == 0:   # (parts mode writes a part file per rank beside it)
            for name in glob.glob(glob.escape(prefix) + "*"):
                os.remove(name)
    if not same:
        return ("fail", "the values read back differ from those written",
                "the file system returned other bytes: try another directory")
    made = "" if existed else " (it did not exist: this check created it)"
    return ("pass", f"{directory}: written by {world.size} rank(s), read back bit for bit"
                    f"{made}", "")


def _devices(facts: Sequence[Dict]) -> Check:
    with_gpus = [f for f in facts if f["gpus"]]
    if not with_gpus:
        return ("skip", "no GPU seen", "")
    bound = [(f["rank"], f["device"]) for f in facts]
    devices_per_node: Dict[Tuple[str, str], List[int]] = {}
    for fact in facts:
        devices_per_node.setdefault((fact["host"], fact["device"]), []).append(fact["rank"])
    shared = {k: v for k, v in devices_per_node.items() if len(v) > 1}
    aware = {f["cuda_aware_mpi"] for f in facts}
    nccl = {f["nccl"] for f in facts}
    found = (f"GPU binding {bound}; CUDA-aware MPI: {sorted(aware)}; NCCL: {sorted(nccl)}")
    if shared:
        return ("fail", found + f"; ranks sharing one GPU: {sorted(shared.values())}",
                "start as many ranks per node as GPUs (--ntasks-per-node = --gpus-per-node)")
    return ("pass", found, "")


def _h5py(facts: Sequence[Dict]) -> Check:
    first = facts[0]
    return ("pass", f"h5py {first['h5py']} on HDF5 {first['hdf5']} (MPI-IO: "
                    f"{'yes' if first['h5py_mpi'] else 'no, not needed for checkpoints'})", "")


# -- the command ----------------------------------------------------------------------------
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _libraries() -> Dict:
    """Which MPI runs, and which mpi4py and h5py are linked to, read before h5py loads."""
    from mpi4py import MPI
    version = MPI.Get_library_version()
    running = ("MPICH" if "MPICH" in version or "Intel" in version else
               "Open MPI" if "Open MPI" in version else None)
    return {"running": running,
            "h5py_mpi_lib": linked_mpi("h5py", "defs*.so"),
            "mpi4py_mpi_lib": linked_mpi("mpi4py", "MPI*.so")}


def _arrays(kind: str) -> Optional[str]:
    """Why the array library of ``kind`` does not import, or ``None``."""
    if kind == "numpy":
        return None
    try:
        __import__("jax" if kind == "jax" else "cupy")
    except Exception as err:  # noqa: BLE001 - reported in the table
        return f"{type(err).__name__}: {err}"
    return None


def _facts(world, arrays: str = "numpy") -> Dict:
    from mpi4py import MPI
    from mpistrat.runtime.local_facts import gpu_facts as _gpus, printable as _clean
    from mpistrat.runtime.devices import cuda_aware_mpi, nccl_available
    from mpistrat.runtime.gpus import choose_gpu
    libraries = _libraries()
    threads = ", ".join(f"{v}={os.environ[v]}" for v in _THREAD_VARIABLES if os.environ.get(v))
    base = {"cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1)), "threads_set": threads, "arrays": arrays,
            "arrays_error": _arrays(arrays), **libraries}
    if judge_libraries(libraries)[0] == "fail":   # never load it: it would crash in libhdf5
        h5 = {"h5py": "not loaded", "hdf5": "?", "h5py_mpi": False}
    else:
        import h5py
        h5 = {"h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
              "h5py_mpi": bool(h5py.get_config().mpi)}
    gpus = _gpus()["gpus"]
    device = f"GPU {choose_gpu(world.local_rank, len(gpus), os.environ).index}" if gpus \
        else "CPU"
    return {"rank": world.rank, "size": world.size, "host": world.hostname,
            "nodes": world.num_nodes, "launcher_size": _launcher_size(),
            "mpi": _clean(MPI.Get_library_version().splitlines()[0]).split(",")[0],
            "gpus": gpus, "device": device, "cuda_aware_mpi": cuda_aware_mpi()[0] if gpus
            else None, "nccl": nccl_available()[0] if gpus else None, **h5, **base,
            "slurm": {k: v for k, v in os.environ.items() if k in (
                "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_NNODES",
                "SLURM_MPI_TYPE", "SLURM_JOB_PARTITION")} or None}


def _minimal_facts(world, err: BaseException) -> Dict:
    """What a rank reports when its full facts could not be gathered (a broken import)."""
    return {"rank": world.rank, "size": world.size, "host": world.hostname,
            "nodes": world.num_nodes, "launcher_size": _launcher_size(),
            "mpi": f"unknown ({type(err).__name__}: {err})", "gpus": [], "device": "?",
            "cuda_aware_mpi": None, "nccl": None, "h5py": "?", "hdf5": "?", "h5py_mpi": False,
            "slurm": None, "cores": [0], "threads_set": "?", "arrays": "numpy",
            "arrays_error": None, "running": None, "h5py_mpi_lib": (None, "?"),
            "mpi4py_mpi_lib": (None, "?")}


def _settings_failed(err: BaseException) -> Optional[List[Dict]]:
    """The table when the ranks' settings disagree (no world can be made: every rank
    raised the same ``SettingError``)."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != 0:
        return None
    return [{"check": "settings", "status": "fail", "found": str(err),
             "fix": "give every rank the same MPISTRAT_* environment (mpirun -x NAME, or "
                    "export it before srun); docs/settings.md"}]


def doctor(directory: str, arrays: str = "numpy") -> Optional[List[Dict]]:
    """Run every check (collective); rank 0 gets the rows ``{check, status, found, fix}``,
    the other ranks ``None``. ``arrays`` names the replicas' array library (numpy, jax or
    cupy), which must import."""
    import mpistrat as ms
    from mpistrat.runtime import get_world
    from mpistrat.runtime.settings import SettingError
    try:
        world = get_world(refuse_singletons=False)    # a singleton start is reported, not raised
    except SettingError as err:                       # (raised alike on every rank)
        return _settings_failed(err)
    try:   # (a rank that cannot answer still reaches every gather below: no hang)
        fact = _facts(world, arrays)
    except Exception as err:  # noqa: BLE001 - reported in the table
        fact = _minimal_facts(world, err)
    launch = judge_launch(fact)
    libraries = judge_libraries(fact)
    facts = world.comm.gather(fact, root=0)
    try:
        collectives = _collectives(ms.MultiWorkerMirroredStrategy(), world)
    except Exception as err:  # noqa: BLE001 - a collective timed out or failed here
        collectives = ("fail", f"{type(err).__name__}: {err}",
                       "a rank is unreachable or MPI failed: run python -m mpistrat info, and "
                       "see docs/troubleshooting.md")
    if world.comm.allreduce(libraries[0] == "fail"):   # h5py would crash on some rank
        checkpoint = ("skip", "not tried: h5py is not linked to this MPI on some rank", "")
    else:
        checkpoint = _checkpoint(directory, world)
    results = world.comm.gather((launch, collectives, checkpoint, libraries,
                                 judge_arrays(fact)), root=0)
    if world.rank != 0:
        return None
    rows = []

    def add(name: str, per_rank: Sequence[Check]) -> None:
        failed = [(r, c) for r, c in enumerate(per_rank) if c[0] == "fail"]
        status, found, fix = failed[0][1] if failed else per_rank[0]
        if failed:
            found = f"rank {failed[0][0]}: {found}" + (
                f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
        rows.append({"check": name, "status": status, "found": found, "fix": fix})

    add("MPI launch", [r[0] for r in results])
    rows.append({"check": "settings", "status": "pass",
                 "found": "every rank has the same MPISTRAT_* values that must agree", "fix": ""})
    add("libraries", [r[3] for r in results])
    add("ranks and nodes", [judge_layout(facts)])
    add("threads", [judge_threads(facts)])
    add("collectives", [r[1] for r in results])
    add("GPUs", [_devices(facts)])
    add("arrays", [r[4] for r in results])
    add("h5py", [_h5py(facts)])
    add("checkpoint dir", [r[2] for r in results])
    add("Slurm", [judge_slurm(facts)])
    return rows


def render(rows: Sequence[Dict]) -> str:
    """The table (pure): one line per check, then the fix under each failure."""
    width = max(len(r["check"]) for r in rows)
    lines = []
    for row in rows:
        lines.append(f"{row['check']:<{width}}  {row['status'].upper():<4}  {row['found']}")
        if row["status"] == "fail":
            lines.append(f"{'':<{width}}        fix: {row['fix']}")
    failed = sum(r["status"] == "fail" for r in rows)
    lines.append("")
    lines.append("ready: every check passed" if not failed else f"{failed} check(s) failed")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python -m mpistrat doctor [--dir DIR] [--json]``; exit 0 only when all pass."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m mpistrat doctor",
                                     description="check this site's MPI, nodes, collectives, "
                                                 "GPUs, h5py and a checkpoint directory")
    parser.add_argument("--dir", default=".", help="a directory the job will write checkpoints "
                                                   "to (default: the current directory)")
    parser.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    parser.add_argument("--arrays", choices=("numpy", "jax", "cupy"), default="numpy",
                        help="the replicas' array library, which must import (default numpy)")
    args = parser.parse_args(argv)
    from mpi4py import MPI
    rows = doctor(args.dir, args.arrays)
    failed = MPI.COMM_WORLD.bcast(   # (the world may be refused: settings that disagree)
        None if rows is None else any(r["status"] == "fail" for r in rows), root=0)
    if rows is not None:
        sys.stdout.write(json.dumps({"checks": rows}, indent=1) + "\n" if args.json
                         else render(rows))
        sys.stdout.flush()
    return 1 if failed else 0
