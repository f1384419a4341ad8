"""Train a handwritten-digit classifier on every rank: data parallel, checkpointed, resumable.

    scripts/mpirun -n 2 .venv/bin/python jobs/train.py          # what `make run` runs

1. Rank 0 writes scikit-learn's bundled digits once as ``.npy`` files (``--data``).
2. ``MultiWorkerMirroredStrategy``: one replica per rank. Parameters and Adam's state are
   ``ms.Variable`` objects made in ``strategy.scope()`` (every rank starts from rank 0's).
3. ``ms.data.NpyDataset(...).batch(global_batch)`` read over MPI-IO and split by
   ``strategy.experimental_distribute_dataset``: each rank reads only its rows of each batch.
   The rows are globally shuffled (``global_shuffle(seed)``): the same global batches at
   any number of ranks, and a restored position is found without reading what came before.
4. Each step, ``strategy.run`` computes the *summed* loss gradient of the replica's rows
   with ``jax.grad``; one all-reduce (SUM) combines gradients and counts, and dividing by
   the global row count makes the update independent of the number of ranks.
   With ``--deterministic`` the parameters end bit for bit the same at any number of ranks
   (and across a resume at another width): each replica computes every example's gradient
   alone, in micro-batches of a fixed shape (the same compiled program for every example),
   and ``strategy.reduce("SUM", per_example, axis=0)`` under
   ``CommunicationOptions(deterministic=True)`` sums all examples of the global batch
   exactly, whichever rank holds them.
5. A ``CheckpointManager`` saves model, optimizer, epoch, metrics and the dataset iterator's
   position; a ``PreemptionCheckpointHandler`` restores the latest checkpoint on start and,
   on SIGTERM/SIGUSR1 to any rank, saves at one agreed step and exits with 75 (requeue).
   Run the same command again and training continues exactly where it stopped.

Flags: ``--data DIR`` (your own ``train.npy``/``test.npy``: float32 rows of features followed
by a label), ``--epochs``, ``--global-batch``, ``--replicas numpy|cupy|tpu``,
``--strategy multiworker|mirrored``, ``--checkpoint-dir``, ``--checkpoint-every STEPS``,
``--deterministic``, ``--micro-batch``. Other ranks print nothing unless ``--all-ranks``.
The chief ends by printing a digest of the parameters' bits.
"""

import argparse
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (jobs/digits.py: data, model, optimizer)

import mpistrat as ms  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="out/digits/data",
                        help="directory of train.npy/test.npy (written from scikit-learn's "
                             "digits when missing; default %(default)s)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--global-batch", type=int, default=64,
                        help="rows per step over all replicas (default %(default)s)")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam's learning rate")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", choices=["numpy", "cupy", "tpu"], default="numpy",
                        help="what a replica is: a host (NumPy), a GPU per rank (CuPy), or "
                             "every JAX device of a host (TPUStrategy)")
    parser.add_argument("--strategy", choices=["multiworker", "mirrored"], default="multiworker",
                        help="MultiWorkerMirroredStrategy (all ranks, default) or "
                             "MirroredStrategy (the ranks of one node)")
    parser.add_argument("--checkpoint-dir", default="out/digits/checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                        help="also save every STEPS steps within an epoch (0: epoch ends only)")
    parser.add_argument("--deterministic", action="store_true",
                        help="bit-identical parameters at any number of ranks: per-example "
                             "gradients summed exactly (CommunicationOptions(deterministic=True))")
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="rows per compiled per-example step with --deterministic "
                             "(default %(default)s)")
    parser.add_argument("--all-ranks", action="store_true",
                        help="every rank prints what it read (other ranks are quiet by default)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.global_batch < 1 or args.checkpoint_every < 0 or \
            args.micro_batch < 1:
        parser.error("--epochs, --global-batch and --micro-batch must be positive, "
                     "--checkpoint-every >= 0")
    if args.deterministic and args.replicas == "tpu":
        parser.error("--deterministic needs --replicas numpy or cupy (a TPUStrategy step is "
                     "one compiled SPMD program; see docs/getting-started.md)")
    return args


def make_strategy(args):
    """The strategy for ``--replicas``/``--strategy``, and two functions that move a step's
    values to the arrays the replicas reduce (``to_replica``) and back to JAX (``from_replica``)."""
    options = None
    if args.deterministic:
        options = ms.CommunicationOptions(deterministic=True)  # reproducible SUM and MEAN
    same = lambda tree: tree  # noqa: E731
    if args.replicas == "tpu":
        resolver = ms.cluster_resolver.TPUClusterResolver(tpu="")
        ms.config.experimental_connect_to_cluster(resolver)
        ms.tpu.experimental.initialize_tpu_system(resolver)   # before any other JAX call
        return ms.TPUStrategy(resolver), same, same           # values stay traced JAX arrays
    import jax
    if args.strategy == "mirrored":
        strategy = ms.MirroredStrategy(cross_device_ops=options)
    else:
        strategy = ms.MultiWorkerMirroredStrategy(communication_options=options)
    if args.replicas == "numpy":
        return strategy, jax.device_get, same                 # NumPy arrays on the host
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # ImportError, or CUDA errors without a GPU
        raise SystemExit(f"--replicas cupy: CuPy with a GPU is not available here ({err}); "
                         f"use --replicas numpy") from None
    from mpistrat.runtime.gpus import bound_device
    gpu = bound_device().index    # the GPU the strategy bound this rank to (and made current)
    jax_gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(jax_gpus) != count:
        raise SystemExit(f"--replicas cupy: CuPy sees {count} GPUs but JAX sees "
                         f"{len(jax_gpus)}; install JAX with CUDA support (jax[cuda])")
    jax.config.update("jax_default_device", jax_gpus[gpu])
    # gradients are all-reduced as CuPy arrays (the library's GPU path), then go back to JAX
    return (strategy, lambda tree: jax.tree_util.tree_map(cupy.from_dlpack, tree),
            lambda tree: jax.tree_util.tree_map(jax.dlpack.from_dlpack, tree))


class Model:
    """Parameters and Adam's state as strategy variables, and the step each replica runs.

    ``train_step(batch)``: ``jax.grad`` of the summed loss over this replica's rows, one
    all-reduce (SUM) of gradients and ``[loss, correct, rows]`` through the replica context,
    division by the global row count, and the Adam update assigned on every replica (the same
    reduced values everywhere, so the replicas stay identical). Returns the global stats.
    """

    def __init__(self, strategy, init, lr: float, to_replica, from_replica, micro_batch=16):
        import jax
        self._map = jax.tree_util.tree_map
        with strategy.scope():   # every rank starts from rank 0's values
            self.params = self._map(lambda a: ms.Variable(a, name="param"), init)
            self.adam_m = self._map(lambda a: ms.Variable(np.zeros_like(a), name="adam_m"), init)
            self.adam_v = self._map(lambda a: ms.Variable(np.zeros_like(a), name="adam_v"), init)
            self.iterations = ms.Variable(np.float32(0), name="iterations")
        self.optimizer_state = {"m": self.adam_m, "v": self.adam_v,
                                "iterations": self.iterations}
        self._lr, self._to, self._from = lr, to_replica, from_replica
        self._grad, self._eval = jax.jit(digits.grad_sums), jax.jit(digits.eval_sums)
        self._update = jax.jit(digits.adam_update)
        self._per_example, self._micro = jax.jit(digits.per_example_grads), micro_batch

    def _read(self, tree):
        return self._map(lambda v: v.read_value(), tree)

    def train_step(self, batch):
        grads, stats = self._grad(self._read(self.params), batch)
        total = self._from(ms.get_replica_context().all_reduce(
            "SUM", {"grads": self._to(grads), "stats": self._to(stats)}))
        return self.apply(total)

    def per_example_step(self, batch):
        """Every row's own gradient and ``[loss, correct, 1]`` (``--deterministic``), computed
        ``micro_batch`` rows at a time with zero rows padding the last micro-batch (dropped)."""
        import jax
        rows = np.asarray(jax.device_get(batch))
        count, micro = rows.shape[0], self._micro
        padded = np.zeros((-(-count // micro) * micro, rows.shape[1]), rows.dtype)
        padded[:count] = rows
        params = self._read(self.params)
        parts = [jax.device_get(self._per_example(params, padded[k:k + micro]))
                 for k in range(0, len(padded), micro)]
        if not parts:   # a replica without rows this step: empty rows of the right shapes
            grads = self._map(lambda p: np.zeros((0,) + np.shape(p), np.float32), params)
            return self._to({"grads": grads, "stats": np.zeros((0, 3), np.float32)})
        joined = self._map(lambda *xs: np.concatenate(xs)[:count], *parts)
        return self._to({"grads": joined[0], "stats": joined[1]})

    def apply(self, total):
        """Adam with the summed gradients over the global row count (the same on every
        replica); returns the global ``[loss sum, correct, rows]``."""
        rows_seen = total["stats"][2]
        grads = self._map(lambda g: g / rows_seen, total["grads"])
        step = self.iterations.read_value() + 1
        new = self._update(self._read(self.params), grads, self._read(self.adam_m),
                           self._read(self.adam_v), step, self._lr)
        for variables, values in zip((self.params, self.adam_m, self.adam_v), new):
            self._map(lambda var, value: var.assign(value), variables, values)
        self.iterations.assign(step)
        return total["stats"]

    def eval_step(self, batch):
        return self._to(self._eval(self._read(self.params), batch))


class History:
    """Per-epoch metrics and the running sums of the epoch in progress (saved in checkpoints)."""

    FIELDS = ("loss", "accuracy", "test_loss", "test_accuracy", "examples_per_second")

    def __init__(self):
        self.epochs = {name: [] for name in self.FIELDS}
        self.running = np.zeros(4)           # loss sum, correct, rows, seconds of this epoch

    def add(self, stats, seconds: float) -> None:
        self.running += np.append(np.asarray(stats, dtype=np.float64), seconds)

    def end_epoch(self, test_stats) -> dict:
        loss, correct, rows, seconds = self.running
        test = np.asarray(test_stats, dtype=np.float64)
        row = {"loss": loss / rows, "accuracy": correct / rows, "test_loss": test[0] / test[2],
               "test_accuracy": test[1] / test[2], "examples_per_second": rows / seconds}
        for name in self.FIELDS:
            self.epochs[name].append(row[name])
        self.running = np.zeros(4)
        return row

    def _serialize_to_tensors(self):
        tensors = {name: np.asarray(values, np.float64) for name, values in self.epochs.items()}
        tensors["running"] = self.running
        return tensors

    def _restore_from_tensors(self, tensors):
        self.epochs = {name: list(np.asarray(tensors[name]).tolist()) for name in self.FIELDS}
        self.running = np.array(tensors["running"], np.float64)


def plot(history: History, path: str, title: str) -> None:
    """Loss and accuracy curves as a PNG (written under a temporary name, then renamed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = np.arange(1, len(history.epochs["loss"]) + 1)
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, name, label in ((left, "loss", "cross-entropy"), (right, "accuracy", "accuracy")):
        axis.plot(epochs, history.epochs[name], "o-", label="train")
        axis.plot(epochs, history.epochs[f"test_{name}"], "s--", label="test")
        axis.set_xlabel("epoch")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    temporary = f"{path}.tmp-{os.getpid()}.png"
    figure.savefig(temporary, dpi=100)
    plt.close(figure)
    os.replace(temporary, path)


def parameter_digest(params) -> str:
    """SHA-256 of the parameters' bits, in the order of their sorted names."""
    import hashlib
    digest = hashlib.sha256()
    for layer in sorted(params):
        for name in sorted(params[layer]):
            digest.update(np.ascontiguousarray(np.asarray(params[layer][name].numpy())).tobytes())
    return digest.hexdigest()


def prepare_once(data_dir: str) -> None:
    """Rank 0 writes the data if missing; every rank raises if that failed."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    error = None
    if comm.Get_rank() == 0:
        try:
            if digits.prepare(data_dir):
                print(f"prepared scikit-learn's digits in {data_dir}", flush=True)
        except Exception as err:  # shared with every rank below
            error = f"rank 0: preparing the data in {data_dir}: {err!r}"
    error = comm.bcast(error, root=0)
    if error:                    # every rank stops with the same message, no abort needed
        raise SystemExit(f"jobs/train.py: {error}")


def main(argv=None) -> int:
    args = parse_args(argv)
    strategy, to_replica, from_replica = make_strategy(args)
    chief = strategy.extended.should_checkpoint
    static = strategy.extended.experimental_require_static_shapes   # TPUStrategy
    prepare_once(args.data)
    train_file, test_file = (os.path.join(args.data, n) for n in (digits.TRAIN, digits.TEST))
    try:                         # the same files on every rank: every rank stops alike
        rows, features, classes = digits.describe(train_file)
        test_features = digits.describe(test_file)[1]
        if test_features != features:
            raise ValueError(f"{train_file} has {features} feature columns but {test_file} "
                             f"has {test_features}")
    except (OSError, ValueError) as err:
        raise SystemExit(f"jobs/train.py: {err}") from None

    from tqdm import tqdm
    model = Model(strategy, digits.init_params(features, args.hidden, classes, args.seed),
                  args.lr, to_replica, from_replica, args.micro_batch)
    with strategy.scope():
        epoch = ms.Variable(np.int64(0), name="epoch")

    options = ms.data.Options()
    options.experimental_distribute.auto_shard_policy = ms.data.AutoShardPolicy.DATA
    train_reader = ms.data.NpyDataset(train_file)
    train = strategy.experimental_distribute_dataset(   # a new order each epoch, any width
        train_reader.global_shuffle(seed=args.seed)
        .batch(args.global_batch, drop_remainder=static).with_options(options))
    test = strategy.experimental_distribute_dataset(
        ms.data.NpyDataset(test_file).batch(args.global_batch, drop_remainder=static)
        .with_options(options))
    steps_per_epoch = rows // args.global_batch if static else -(-rows // args.global_batch)

    def local(value):  # this rank's result of strategy.run as a NumPy array
        return np.asarray(strategy.experimental_local_results(value)[0])

    history = History()
    iterator = iter(train)
    checkpoint = ms.Checkpoint(model=model.params, optimizer=model.optimizer_state,
                               epoch=epoch, history=history, iterator=iterator)
    manager = ms.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)
    handler = ms.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, manager)       # restores the latest checkpoint, if any
    if chief:
        print(f"{strategy.num_replicas_in_sync} replicas ({type(strategy).__name__}, "
              f"{args.replicas}), {rows} training rows, global batch {args.global_batch}, "
              f"{steps_per_epoch} steps per epoch", flush=True)
        if handler.restored_from and int(epoch) >= args.epochs:
            print(f"{handler.restored_from} has finished {int(epoch)} epochs already: nothing "
                  f"to train (raise --epochs to go on, or use another --checkpoint-dir)",
                  flush=True)
        elif handler.restored_from:
            print(f"resumed from {handler.restored_from}: epoch {int(epoch) + 1}, step "
                  f"{handler.total_run_calls - int(epoch) * steps_per_epoch} of "
                  f"{steps_per_epoch}", flush=True)

    def one_step():
        batch = next(iterator)        # after the preemption check: a saved position is exact
        if args.deterministic:        # every example's gradient, then one exact sum of them all
            per_example = strategy.run(model.per_example_step, args=(batch,))
            return model.apply(model._from(strategy.reduce("SUM", per_example, axis=0)))
        return strategy.run(model.train_step, args=(batch,))

    # mpirun gives ranks a terminal of size 0x0 (tqdm would then hide its bar): use the
    # size of ours when known, else 100 columns
    columns, lines = shutil.get_terminal_size((100, 24))
    while int(epoch) < args.epochs:
        done = handler.total_run_calls - int(epoch) * steps_per_epoch
        bar = tqdm(total=steps_per_epoch, initial=done, disable=not chief, leave=False,
                   desc=f"epoch {int(epoch) + 1}/{args.epochs}", unit="step", file=sys.stdout,
                   mininterval=0.2, ncols=columns, nrows=lines)
        while True:
            start = time.perf_counter()
            try:
                stats = handler.run(one_step)
            except StopIteration:
                break
            # the slowest rank's step time, the same on every rank: a checkpoint holds one value
            seconds = float(strategy.reduce("MAX", time.perf_counter() - start, axis=None))
            history.add(local(stats), seconds)
            bar.update(1)
            if args.checkpoint_every and handler.total_run_calls % args.checkpoint_every == 0:
                manager.save()
        bar.close()
        test_stats = np.zeros(3)
        for batch in test:
            test_stats += np.asarray(strategy.reduce(
                "SUM", strategy.run(model.eval_step, args=(batch,)),
                axis=None), dtype=np.float64)
        row = history.end_epoch(test_stats)
        epoch.assign_add(1)
        iterator = iter(train)
        checkpoint.iterator = iterator    # the next epoch starts at its first batch
        manager.save()
        if chief:
            print(f"epoch {int(epoch):3d}/{args.epochs}  loss {row['loss']:.4f}  accuracy "
                  f"{row['accuracy']:.4f}  test loss {row['test_loss']:.4f}  test accuracy "
                  f"{row['test_accuracy']:.4f}  {row['examples_per_second']:,.0f} examples/s",
                  flush=True)
        if args.all_ranks:
            print(f"[rank {strategy.cluster_resolver.task_id}] read "
                  f"{train_reader.bytes_read:,} bytes of training data so far", flush=True)

    if chief:
        accuracy = history.epochs["test_accuracy"][-1]
        curves = os.path.join(args.checkpoint_dir, "curves.png")
        try:
            plot(history, curves, f"digits: {strategy.num_replicas_in_sync} replicas, "
                                  f"{type(strategy).__name__}")
        except ImportError as err:
            curves = f"not drawn ({err.name} is not installed)"
        print(f"test accuracy: {accuracy:.3f}")
        print(f"parameter digest: {parameter_digest(model.params)}")
        print(f"checkpoints: {os.path.abspath(args.checkpoint_dir)} (latest "
              f"{os.path.basename(manager.latest_checkpoint)}.h5, HDF5: h5py or h5dump open it)")
        print(f"curves: {os.path.abspath(curves) if curves.endswith('.png') else curves}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
