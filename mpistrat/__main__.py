"""``python -m mpistrat info``: what this job's ranks see (MPI, nodes, h5py, devices).

    mpirun -n 2 python -m mpistrat info
"""

import argparse
import json
import sys


def info() -> dict:
    """A summary of this rank's environment, as a dict."""
    import h5py
    import mpi4py
    from mpi4py import MPI

    from mpistrat.checkpoint.h5write import checkpoint_mode
    from mpistrat.runtime import get_world
    from mpistrat.collectives.backends.describe import describe_backends
    from mpistrat.collectives.topology import comm_topology
    from mpistrat.runtime.devices import cuda_aware_mpi, nccl_available
    from mpistrat.runtime.gpus import count_gpus

    world = get_world()
    return {
        "rank": world.rank, "size": world.size, "host": world.hostname,
        "node": world.node_index, "nodes": world.num_nodes,
        "local_rank": world.local_rank, "local_size": world.local_size,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": mpi4py.__version__, "thread_level": MPI.Query_thread(),
        "h5py": h5py.__version__, "h5py_mpi": bool(h5py.get_config().mpi),
        "checkpoint_mode": checkpoint_mode(),
        "cuda_aware_mpi": cuda_aware_mpi()[1], "nccl": nccl_available()[1],
        "jax": _version("jax"),  # for TPUStrategy; read from metadata, JAX is not started
        "gpus": count_gpus(),
        # which backend and algorithm each array kind and size would get, and why
        "backends": describe_backends(world.size, comm_topology(world.comm)),
    }


def _version(package: str):
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpistrat")
    parser.add_argument("command", choices=["info"], help="info: describe every rank")
    parser.parse_args(argv)
    from mpistrat.runtime import get_world
    rows = get_world().comm.gather(info(), root=0)
    if rows is not None:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
