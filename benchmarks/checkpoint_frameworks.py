"""Checkpoints of framework state against the same arrays saved by hand (issue 16's figure).

Run: scripts/mpirun -n N .venv/bin/python benchmarks/checkpoint_frameworks.py [--dir DIR]

Two states, each measured in the same run, best of ``--repeats``:

* ``keras``: a Keras 3 (JAX backend) MLP with Adam after one training step (kernels, biases,
  ``iterations`` and both moment slots), saved as ``ms.Checkpoint(model=m, optimizer=o)``;
* ``optax``: a dict of JAX parameters and ``optax.adam(1e-3).init(params)`` (NamedTuples of JAX
  arrays), saved as ``ms.Checkpoint(params=p, opt_state=s)``.

Baselines: ``by_hand`` saves the same arrays, copied to NumPy by the user into a flat dict,
with ``ms.Checkpoint`` (what a user wrote before the graph walked frameworks: the walk's own
cost is the difference); ``raw`` writes them with ``np.savez`` on rank 0 plus ``fsync`` (no
partitions, no checksums, no agreement). Restores are timed the same way (``raw``: ``np.load``
of every array). One JSON line on rank 0 with seconds and ratios ours / baseline.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import optax  # noqa: E402

import mpistrat as ms  # noqa: E402


def keras_state(width: int):
    keras.utils.set_random_seed(0)   # the same initial weights on every rank
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((64, width), dtype=np.float32), rng.integers(0, 10, 64),
              batch_size=64, epochs=1, verbose=0)
    leaves = [np.asarray(v.value) for v in model.variables + model.optimizer.variables]
    return {"model": model, "optimizer": model.optimizer}, leaves


def optax_state(width: int):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {f"layer{i}": {"w": jax.random.normal(k, (width, width), jnp.float32),
                            "b": jnp.zeros((width,), jnp.float32)} for i, k in enumerate(keys)}
    opt_state = optax.adam(1e-3).init(params)
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, opt_state))]
    return {"params": params, "opt_state": opt_state}, leaves


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        fn()
        MPI.COMM_WORLD.Barrier()
        times.append(time.perf_counter() - start)
    return min(times)


def raw_save(path: str, leaves) -> None:
    if MPI.COMM_WORLD.rank == 0:
        with open(path, "wb") as handle:
            np.savez(handle, *leaves)
            handle.flush()
            os.fsync(handle.fileno())


def raw_restore(path: str) -> None:
    with np.load(path) as data:
        [data[k] for k in data.files]


def measure(name: str, objects: dict, leaves, directory: str, repeats: int) -> dict:
    comm = MPI.COMM_WORLD
    by_hand = {f"v{i}": leaf for i, leaf in enumerate(leaves)}
    prefix = {"ours": os.path.join(directory, name, "ours"),
              "by_hand": os.path.join(directory, name, "hand")}
    raw_path = os.path.join(directory, name, "raw.npz")
    ours_ckpt, hand_ckpt = ms.Checkpoint(**objects), ms.Checkpoint(**by_hand)
    saved = {}

    def save(key, ckpt):
        def run():
            saved[key] = ckpt.write(prefix[key])
        return run

    if comm.rank == 0:
        os.makedirs(os.path.join(directory, name), exist_ok=True)
    comm.Barrier()
    out = {"state": name, "arrays": len(leaves),
           "mib": sum(leaf.nbytes for leaf in leaves) / 2**20,
           "save_ours_s": best(save("ours", ours_ckpt), repeats),
           "save_by_hand_s": best(save("by_hand", hand_ckpt), repeats),
           "save_raw_s": best(lambda: raw_save(raw_path, leaves), repeats)}
    out["restore_ours_s"] = best(lambda: ours_ckpt.read(saved["ours"]).assert_consumed(), repeats)
    out["restore_by_hand_s"] = best(lambda: hand_ckpt.read(saved["by_hand"]).assert_consumed(),
                                    repeats)
    out["restore_raw_s"] = best(lambda: raw_restore(raw_path), repeats)
    for op in ("save", "restore"):
        out[f"{op}_ours_vs_by_hand"] = out[f"{op}_ours_s"] / out[f"{op}_by_hand_s"]
        out[f"{op}_ours_vs_raw"] = out[f"{op}_ours_s"] / out[f"{op}_raw_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None)
    parser.add_argument("--width", type=int, default=1024, help="hidden width (MLP and optax)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ms.MultiWorkerMirroredStrategy()
    comm = MPI.COMM_WORLD
    directory = comm.bcast(args.dir or tempfile.mkdtemp(prefix="ckpt-frameworks-",
                                                        dir=os.environ.get("TMPDIR", "/tmp"))
                           if comm.rank == 0 else None, root=0)
    for name, make in (("keras", keras_state), ("optax", optax_state)):
        objects, leaves = make(args.width)
        record = measure(name, objects, leaves, directory, args.repeats)
        emit(comm, dict(benchmark="checkpoint_frameworks", ranks=comm.size, **record))


if __name__ == "__main__":
    main()
