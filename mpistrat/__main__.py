"""``python -m mpistrat info``: what this job's ranks see, as a table on rank 0 (or ``--json``).

    mpirun -n 2 python -m mpistrat info          # one row per rank, then the facts
    mpirun -n 2 python -m mpistrat info --json   # the same as one JSON document
    python -m mpistrat plan --nodes 64 --model resnet50   # predicted all-reduce (simulate/plan.py)
    mpirun -n 4 python -m mpistrat tune --output tuning.json   # measured choices (calibration.py)

Rows: rank, host, node, local rank, the device the rank would bind, and the collective
backend chosen for each array kind (NumPy, CuPy, JAX). Facts: the MPI library and thread
level, CUDA-awareness and how it was decided, NCCL, parallel h5py, CuPy and JAX with their
devices (asked once per node, on its first rank, with GPU memory preallocation off), and the
Slurm allocation when inside one.
"""

import argparse
import json
import os
import sys
from typing import List, Optional

from mpistrat.runtime.local_facts import gpu_facts, jax_facts, package_version, printable

_THREAD_LEVELS = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED",
                  3: "MPI_THREAD_MULTIPLE"}
_SLURM = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_PARTITION", "SLURM_JOB_NODELIST",
          "SLURM_NNODES", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE", "SLURM_CPUS_PER_TASK",
          "SLURM_GPUS_PER_TASK", "SLURM_RESTART_COUNT")


def jax_paths_told_truly(paths: List[dict], platform: Optional[str], cupy: bool) -> List[dict]:
    """The collective paths with the JAX rows saying what happens to this rank's JAX arrays.

    The staged backend's reason speaks of device memory and pinned buffers,
    which is what it does with GPU arrays and CuPy; host (CPU) JAX arrays are
    read in place and reduced by the host algorithms (pure)::

        >>> row = {"kind": "jax", "bytes": 4096, "backend": "staged-host-mpi",
        ...        "algorithm": "ring", "why": "device memory ...; small"}
        >>> jax_paths_told_truly([row], "cpu", False)[0]["why"].split(";")[0]
        'host (CPU) JAX arrays: read in place as NumPy, reduced by the host algorithms, the result put back as a JAX array (no device copy, no staging)'
    """
    told = []
    for path in paths:
        path = dict(path)
        if path.get("kind") == "jax" and path.get("backend") == "staged-host-mpi":
            _, _, reason = path["why"].partition("; ")
            if platform == "cpu":
                path["why"] = ("host (CPU) JAX arrays: read in place as NumPy, reduced by the "
                               "host algorithms, the result put back as a JAX array (no device "
                               "copy, no staging); " + reason)
            elif platform is not None and not cupy:
                path["why"] = (f"JAX {platform.upper()} arrays copied whole to host memory by "
                               f"JAX (no CuPy here to stage through pinned buffers), reduced by "
                               f"the host algorithms, copied back; " + reason)
        told.append(path)
    return told


def info() -> dict:
    """A summary of this rank's environment, as a dict (collective over the world)."""
    import h5py
    import mpi4py
    from mpi4py import MPI

    from mpistrat.checkpoint.h5write import checkpoint_mode
    from mpistrat.collectives.backends import select_backend
    from mpistrat.collectives.backends.describe import describe_backends
    from mpistrat.collectives.calibration import describe as describe_tuning
    from mpistrat.collectives.topology import comm_topology
    from mpistrat.collectives.options import CommunicationImplementation
    from mpistrat.runtime import get_world
    from mpistrat.runtime.devices import capabilities, cuda_aware_mpi, nccl_available
    from mpistrat.runtime.gpus import choose_gpu

    world = get_world()
    gpus = gpu_facts()
    device = "CPU"
    if gpus["gpus"]:
        index = choose_gpu(world.local_rank, len(gpus["gpus"]), os.environ).index
        device = f"GPU {index} ({gpus['gpus'][index]})"
    caps = capabilities()
    installed = {"numpy": True, "cupy": bool(gpus["gpus"]), "jax": package_version("jax") is not None}
    backends = {}
    for kind, present in installed.items():
        try:
            backends[kind] = (select_backend(kind, CommunicationImplementation.AUTO, caps,
                                             comm_topology(world.comm)).name
                              if present else None)
        except ValueError as err:
            backends[kind] = f"none ({err})"
    # JAX is started once per node (several processes must not claim one accelerator)
    jax_seen = jax_facts() if world.local_rank == 0 else {"jax": package_version("jax"),
                                                              "jax_devices": None,
                                                              "jax_platform": None}
    major, minor = MPI.Get_version()
    return {
        "rank": world.rank, "size": world.size, "host": world.hostname,
        "node": world.node_index, "nodes": world.num_nodes,
        "local_rank": world.local_rank, "local_size": world.local_size,
        "device": device, "backends": backends,
        "mpi": printable(MPI.Get_library_version().splitlines()[0]).rstrip(","),
        "mpi_standard": f"{major}.{minor}", "mpi4py": mpi4py.__version__,
        "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "cuda_aware_mpi": cuda_aware_mpi()[0], "cuda_aware_mpi_how": cuda_aware_mpi()[1],
        "nccl": nccl_available()[0], "nccl_how": nccl_available()[1],
        "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
        "h5py_mpi": bool(h5py.get_config().mpi),
        "checkpoint_mode": checkpoint_mode(),
        "cupy": gpus["cupy"], "gpus": gpus["gpus"], **jax_seen,
        "slurm": {k: os.environ[k] for k in _SLURM if k in os.environ} or None,
        # which backend and algorithm each array kind and size would take, and why
        "collective_paths": jax_paths_told_truly(
            describe_backends(world.size, comm_topology(world.comm), caps),
            jax_seen.get("jax_platform"), caps.cupy),
        # the measured table the host all-reduce follows, and where it came from
        "tuning": describe_tuning(world.comm),
    }


def render(rows: List[dict]) -> str:
    """The table and facts printed by ``info`` (pure: rows in, text out)."""
    kinds = ("numpy", "cupy", "jax")
    header = ["rank", "host", "node", "local rank", "device"] + [f"{k} backend" for k in kinds]
    table = [[str(r["rank"]), r["host"], f"{r['node']}/{r['nodes']}",
              f"{r['local_rank']}/{r['local_size']}", r["device"]]
             + [r["backends"][k] or "(not installed)" for k in kinds] for r in rows]
    widths = [max(len(line[i]) for line in [header] + table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
             for line in [header] + table]
    first = rows[0]

    def agreed(key):
        values = {json.dumps(r[key], sort_keys=True) for r in rows}
        note = "" if len(values) == 1 else f"  (differs across ranks: {sorted(values)})"
        return first[key], note

    def fact(label, text):
        lines.append(f"{label:<16}{text}")

    lines.append("")
    fact("MPI", f"{first['mpi']} (MPI {first['mpi_standard']}), mpi4py {first['mpi4py']}")
    fact("thread level", "%s%s" % agreed("thread_level"))
    fact("layout", f"{first['size']} ranks on {first['nodes']} node(s)")
    aware, note = agreed("cuda_aware_mpi")
    fact("CUDA-aware MPI", f"{'yes' if aware else 'no'}: {first['cuda_aware_mpi_how']}{note}")
    nccl, note = agreed("nccl")
    fact("NCCL", f"{'yes' if nccl else 'no'}: {first['nccl_how']}{note}")
    fact("h5py", f"{first['h5py']} on HDF5 {first['hdf5']}, parallel (MPI-IO): "
                 f"{'yes' if first['h5py_mpi'] else 'no'}; checkpoints: {first['checkpoint_mode']}")
    cupy = first["cupy"] or "not installed"
    fact("CuPy", f"{cupy}; GPUs on rank 0's node: {', '.join(first['gpus']) or 'none'}")
    for r in rows:
        if r["jax_devices"] is not None:
            devices = ", ".join(r["jax_devices"]) or "none"
            fact("JAX" if r is first else "", f"{r['jax'] or 'not installed'} on {r['host']}: "
                                              f"{devices}" if r["jax"] else "not installed")
            if not first["jax"]:
                break
    slurm = first["slurm"]
    fact("Slurm", "not inside an allocation" if not slurm else
         ", ".join(f"{k.replace('SLURM_', '').lower()}={v}" for k, v in slurm.items()))
    lines.append("")
    lines.append("collective paths (all-reduce, rank 0's view):")
    for path in first.get("collective_paths", []):
        size = _bytes(path["bytes"])
        lines.append(f"  {path['kind']:<6}{size:>8}  " + (
            f"{path['backend']} / {path['algorithm']}: {path['why']}" if "backend" in path
            else f"none: {path['error']}"))
    lines.extend(render_tuning(first.get("tuning")))
    return "\n".join(lines) + "\n"


def render_tuning(tuning: Optional[dict]) -> List[str]:
    """The tuning table's lines (pure): where it came from, then one line per entry."""
    if not tuning:
        return []
    def listed(times: dict) -> str:
        return ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in times.items())

    lines = ["", f"tuning table: {tuning['source']}"]
    for row in tuning["entries"]:
        online = listed(row.get("online", {}))
        place = "in place" if row.get("place") == "in" else "separate"
        lines.append(f"  {row['class']}-byte {_bytes(row['bytes']):>8} {place:<8}  "
                     f"{row['algorithm']:<13}"
                     f"{listed(row['times'])}" + (f"; in real calls: {online}" if online else ""))
    return lines


def tune(argv) -> int:
    """``python -m mpistrat tune [--output PATH] [--budget S]``: calibrate and write the file."""
    parser = argparse.ArgumentParser(prog="python -m mpistrat tune",
                                     description="measure the all-reduce algorithms on this "
                                                 "job's ranks and write the tuning file")
    parser.add_argument("--output", help="the file (default: MPISTRAT_TUNING_FILE)")
    parser.add_argument("--budget", type=float, default=10.0,
                        help="seconds at most (default 10: ahead of a job it may take longer "
                             "than the 2 s of a calibration at first use, and measure up to "
                             "64 MiB)")
    args = parser.parse_args(argv)
    from mpistrat.collectives import calibration
    from mpistrat.runtime import get_world, settings
    comm = get_world().comm
    path = args.output or settings.get("MPISTRAT_TUNING_FILE")
    if comm.Get_size() == 1:
        sys.stdout.write("one rank: nothing to tune (run it under mpirun with the job's "
                         "layout)\n")
        return 0
    try:
        table = calibration.tune(comm, path, args.budget)
    except OSError as err:   # (raised on every rank: the file could not be written)
        if comm.Get_rank() == 0:
            sys.stderr.write(f"python -m mpistrat tune: {err}\n")
        return 1
    if comm.Get_rank() == 0:
        sys.stdout.write("\n".join(render_tuning(
            {"source": table.source, "entries": table.rows()})).lstrip("\n") + "\n")
        if path is None:
            sys.stdout.write("(not written: give --output or MPISTRAT_TUNING_FILE)\n")
        sys.stdout.flush()
    return 0


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["convert"]:  # checkpoints between TensorFlow's format and ours
        from mpistrat.convert import main as convert
        return convert(argv[1:])
    if argv[:1] == ["plan"]:  # the simulator's own command (mpistrat/simulate/plan.py)
        from mpistrat.simulate.plan import main as plan
        return plan(argv[1:])
    if argv[:1] == ["tune"]:  # measure the all-reduce algorithms, write the tuning file
        return tune(argv[1:])
    if argv[:1] == ["doctor"]:  # is this site's set-up ready? (mpistrat/doctor.py)
        from mpistrat.doctor import main as doctor
        return doctor(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m mpistrat")
    parser.add_argument("command", choices=["info", "doctor", "plan", "convert", "tune"],
                        help="info: describe every rank; doctor: check this site's set-up, "
                             "with a fix for each failure (python -m mpistrat doctor --help); "
                             "tune: measure the all-reduce algorithms "
                             "and write the tuning file (python -m mpistrat tune --help); plan: predict a cluster's all-reduce "
                             "(python -m mpistrat plan --help); convert: checkpoints between "
                             "TensorFlow's format and ours (python -m mpistrat convert --help)")
    parser.add_argument("--json", action="store_true", help="one JSON document on rank 0")
    args = parser.parse_args(argv)
    from mpistrat.collectives import CollectiveEngine
    from mpistrat.runtime import get_world
    rows = CollectiveEngine(get_world().comm).gather_object(info(), 0, "info: each rank's row")
    if rows is not None:
        sys.stdout.write(json.dumps({"ranks": rows}, indent=1) + "\n" if args.json
                         else render(rows))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
