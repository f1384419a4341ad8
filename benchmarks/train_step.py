"""Main-job benchmark: one training step of jobs/train.py against the same step in raw mpi4py.

Run: scripts/mpirun -n N .venv/bin/python benchmarks/train_step.py [--steps 300]

Three loops over the same in-memory digits batches (global batch 64, split as the strategy
splits it) and the same jitted JAX functions (``jax.grad`` of the summed loss, Adam):

* ``raw``: jitted gradients to NumPy, packed into one buffer, ``comm.Allreduce`` on a
  duplicate of COMM_WORLD, unpacked, jitted Adam update, parameters kept as NumPy arrays;
* ``strategy``: ``strategy.run(model.train_step, args=(batch,))`` with the job's ``Model``
  (``ReplicaContext.all_reduce`` of the gradient dict, ``ms.Variable`` reads and assigns);
* ``job_loop``: the job's own loop: ``NpyDataset`` read over MPI-IO,
  ``experimental_distribute_dataset`` and ``PreemptionCheckpointHandler.run`` around
  ``strategy.run`` (no checkpoint saves).

Prints one JSON line per loop: median and mean seconds per step (slowest rank) and their
ratios to ``raw`` measured in the same run.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "jobs"))
from common import emit  # noqa: E402

import digits  # noqa: E402
import mpistrat as ms  # noqa: E402
from train import Model  # noqa: E402


def timed_pass(comm, step, batches) -> list:
    """The slowest rank's time of each step of one pass over ``batches``."""
    times = []
    for batch in batches:
        comm.Barrier()
        start = time.perf_counter()
        step(batch)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=8, help="passes over the 23 batches")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mpistrat-digits"))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        digits.prepare(args.dir)
    comm.Barrier()
    import jax
    train_file = os.path.join(args.dir, digits.TRAIN)
    rows_all = np.load(train_file)
    _, features, classes = digits.describe(train_file)
    init = digits.init_params(features, 64, classes, 0)
    # this rank's slice of every global batch of 64, as the strategy cuts it
    from mpistrat.data.rebatch import rebatch_slices
    batches = []
    for start in range(0, len(rows_all), 64):
        batch = rows_all[start:start + 64]
        a, b = rebatch_slices(len(batch), size)[rank]
        batches.append(np.ascontiguousarray(batch[a:b]))

    # raw: the same math, one Allreduce of a packed buffer
    grad_fn, update_fn = jax.jit(digits.grad_sums), jax.jit(digits.adam_update)
    leaves, treedef = jax.tree_util.tree_flatten(init)
    raw = {"p": init, "m": jax.tree_util.tree_map(np.zeros_like, init),
           "v": jax.tree_util.tree_map(np.zeros_like, init), "t": np.float32(0)}
    sizes = [leaf.size for leaf in leaves]
    send = np.empty(sum(sizes) + 3, np.float32)
    recv = np.empty_like(send)

    def raw_step(batch):
        grads, stats = jax.device_get(grad_fn(raw["p"], batch))
        np.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(grads)] + [stats],
                       out=send)
        comm.Allreduce(send, recv, op=MPI.SUM)
        total = recv / recv[-1]
        parts = np.split(total[:-3], np.cumsum(sizes)[:-1])
        mean = jax.tree_util.tree_unflatten(
            treedef, [p.reshape(leaf.shape) for p, leaf in zip(parts, leaves)])
        raw["t"] = raw["t"] + 1
        p, m, v = jax.device_get(update_fn(raw["p"], mean, raw["m"], raw["v"], raw["t"], 5e-3))
        raw.update(p=p, m=m, v=v)
        return recv[-3:]

    strategy = ms.MultiWorkerMirroredStrategy()
    model = Model(strategy, init, 5e-3, jax.device_get, lambda tree: tree)

    def strategy_step(batch):
        return strategy.run(model.train_step, args=(batch,))

    # the job's loop: MPI-IO reader, distributed dataset, preemption handler
    options = ms.data.Options()
    options.experimental_distribute.auto_shard_policy = ms.data.AutoShardPolicy.DATA
    dataset = strategy.experimental_distribute_dataset(
        ms.data.NpyDataset(train_file).batch(64).with_options(options))
    checkpoint_dir = tempfile.mkdtemp() if rank == 0 else None
    checkpoint_dir = comm.bcast(checkpoint_dir, root=0)
    manager = ms.CheckpointManager(ms.Checkpoint(model=model.params), checkpoint_dir, 1)
    handler = ms.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, manager)

    def job_pass():
        iterator, times = iter(dataset), []
        while True:
            comm.Barrier()
            start = time.perf_counter()
            try:
                handler.run(lambda: strategy.run(model.train_step, args=(next(iterator),)))
            except StopIteration:
                return times
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))

    # passes interleaved, so that the machine's changing load hits every loop alike;
    # the first pass of each warms up (JIT compilation, caches) and is not counted
    times = {"raw": [], "strategy": [], "job_loop": []}
    for repeat in range(args.repeats + 1):
        for name, one_pass in (("raw", lambda: timed_pass(comm, raw_step, batches)),
                               ("strategy", lambda: timed_pass(comm, strategy_step, batches)),
                               ("job_loop", job_pass)):
            measured = one_pass()
            if repeat:
                times[name] += measured
    base_median, base_mean = np.median(times["raw"]), np.mean(times["raw"])
    for name, values in times.items():
        emit(comm, {"benchmark": "train_step", "loop": name, "ranks": size, "global_batch": 64,
                    "median_s": round(float(np.median(values)), 7),
                    "mean_s": round(float(np.mean(values)), 7),
                    "median_ratio_to_raw": round(float(np.median(values) / base_median), 3),
                    "mean_ratio_to_raw": round(float(np.mean(values) / base_mean), 3)})


if __name__ == "__main__":
    main()
