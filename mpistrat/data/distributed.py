"""Datasets distributed over the replicas: rebatching, auto-sharding, lockstep ends.

``distribute_dataset(strategy, dataset)`` follows TensorFlow's
``MultiWorkerMirroredStrategy`` with one replica per worker (DESIGN.md section 2):

* ``DATA`` (and ``AUTO`` for in-memory sources): every rank walks the global
  batches and keeps its rebatch slice (``rebatch_slices``); for a file reader
  followed by ``.batch`` a rank reads only the rows it keeps.
* ``FILE`` (and ``AUTO`` for a reader with at least as many files as ranks):
  rank r reads files r, r+N, ... and cuts its stream into batches of
  ``ceil(G / N)`` rows.
* ``OFF``: no sharding; every rank yields all N slices of every global batch,
  one per step, so data is duplicated across ranks as in TensorFlow.

Every step, the ranks agree with a MAX all-reduce whether any of them still
has data: all ranks stop on the same step, and a rank that ran dry meanwhile
yields 0-row batches of the right dtype and inner shape (as TensorFlow does),
so no rank's data is dropped and none waits alone.
Iterating yields ``PerReplica`` values for ``strategy.run``.

With several replicas per rank (``TPUStrategy``: one per JAX device) the rank
is the unit of sharding above and its batch is cut into equal per-device
pieces. Such strategies need static shapes, as TPUs do: batches must come
from ``.batch(G, drop_remainder=True)`` with ``G`` divisible by
``num_replicas_in_sync`` (a clear ``ValueError`` otherwise), and the ranks
stop together on the first step where any rank has no full batch left.
There, as in TensorFlow, batches are fetched to the devices ahead of the step
(``InputOptions.experimental_fetch_to_device``, default on): a thread keeps
``experimental_per_replica_buffer_size`` batches (default: 1 on accelerators,
none on CPU devices) laid out on the devices, and ``run`` uses them as they are.

On GPU replicas (``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``
bound to a GPU, CuPy installed) batches are fetched to the GPU the same way:
a thread copies the next batch (``experimental_per_replica_buffer_size``,
default 1) into CuPy arrays on a stream of its own while the current step
runs; ``experimental_fetch_to_device=False`` keeps them NumPy.
"""

from typing import Any, Callable, Iterator

import numpy as np

from mpistrat import nest
from mpistrat.collectives import ReduceOp
from mpistrat.collectives.agreement import Failure, agree_errors
from mpistrat.data.dataset import Dataset, _prefetched
from mpistrat.data.options import AutoShardPolicy
from mpistrat.data.readers import BatchedRecords
from mpistrat.data.rebatch import rebatch_slices
from mpistrat.distribute.context import InputContext
from mpistrat.distribute.options import InputOptions
from mpistrat.distribute.strategy import register_input_distribution
from mpistrat.distribute.values import PerReplica
from mpistrat.runtime import timeline

__all__ = ["DistributedDataset", "DistributedIterator", "distribute_dataset", "distribute_datasets_from_function"]


def _rows(batch: Any) -> int:
    leaves = nest.flatten(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def _slice(batch: Any, start: int, stop: int) -> Any:
    return nest.map_structure(lambda leaf: np.asarray(leaf)[start:stop], batch)


class DistributedDataset:
    """Iterable of ``PerReplica`` batches, in lockstep over all ranks."""

    def __init__(self, strategy, make_local: Callable[[], Iterator[Any]], options=None):
        self._strategy = strategy
        self._make_local = make_local  # yields tuples: one component per local replica
        self._options = options

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self._strategy, self._make_local, self._options)


class DistributedIterator:
    """Yields ``PerReplica`` batches in lockstep; its position can be checkpointed.

    ``ms.Checkpoint(iterator=it)`` saves the number of steps taken; restoring
    it into a fresh iterator of the same dataset (same seeds) replays that many
    steps, so a resumed job neither repeats nor skips an element. Replaying
    reads the data again: the cost grows with the position.
    """

    def __init__(self, strategy, make_local: Callable[[], Iterator[Any]], options=None):
        self._engine = strategy.extended.engine
        self._replica_ids = strategy.extended.local_replica_ids
        self._static = strategy.extended.experimental_require_static_shapes
        self._local = iter(make_local())
        stage = getattr(strategy.extended, "stage_per_replica", None)
        options = options or InputOptions()
        self._gpu = _gpu_of(strategy) if options.experimental_fetch_to_device is not False \
            and stage is None else None
        if self._gpu is not None:  # GPU replicas: copy the next batch while this step runs
            depth = options.experimental_per_replica_buffer_size
            moved = _to_gpu(self._local, self._gpu)
            self._local = iter(_prefetched(moved, 1 if depth is None else depth)
                               if depth != 0 else moved)
        if stage is not None and options.experimental_fetch_to_device is not False:
            # batches go to the devices ahead of the step, in a thread when a depth is given
            depth = options.experimental_per_replica_buffer_size
            if depth is None:
                depth = strategy.extended.default_prefetch_depth
            staged = _staged(self._local, stage)
            self._local = iter(_prefetched(staged, depth) if depth > 0 else staged)
        self._template = None  # the last batch seen: the model for 0-row batches
        self._steps = 0
        self._replay = 0

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> PerReplica:
        while self._replay:
            self._replay -= 1
            self._advance()
        return self._advance()

    def get_next(self) -> PerReplica:
        return next(self)

    def _next_local(self):
        """This rank's next element (or ``_END``) and its failure, if reading it failed."""
        try:
            return next(self._local, _END), None
        except Exception as err:  # noqa: BLE001 - agreed with the other ranks, then raised
            return _END, Failure(err, self._engine.rank, "reading its input")

    def _advance(self) -> PerReplica:
        if timeline.ON:
            with timeline.span("dataset step", "data", step=self._steps):
                return self._step()
        return self._step()

    def _step(self) -> PerReplica:
        element, failure = self._next_local()
        if self._static:  # full batches only: stop when any rank has none left
            # ranks without a batch and ranks that failed, counted by a float SUM: it
            # travels inside the validation probe (one collective per step)
            flags = self._engine.all_reduce(
                np.array([element is _END, failure is not None], np.float64), ReduceOp.SUM)
            if flags[1]:
                agree_errors(self._engine, failure, f"input step {self._steps}")
            if flags[0]:
                raise StopIteration
            self._steps += 1
            return _regroup(*element, self._replica_ids) if isinstance(element, _Prepared) \
                else _regroup(element, None, self._replica_ids)
        if element is not _END:
            self._template = element
        needs = element is _END and self._template is None
        flags = self._engine.all_reduce(  # counts of ranks with data / needing the layout /
            np.array([element is not _END, needs, failure is not None],  # failing to read
                     dtype=np.float64), ReduceOp.SUM)
        if flags[2]:  # a rank could not read (a truncated file, say): every rank raises
            agree_errors(self._engine, failure, f"input step {self._steps}")
        if not flags[0]:
            raise StopIteration  # no rank has data left: everyone stops on this step
        if flags[1]:  # a rank that never had data learns the batch layout from one that did
            specs = self._engine.comm.allgather(
                None if self._template is None else _spec(self._template))
            if self._template is None:
                self._template = _from_spec(next(x for x in specs if x is not None))
        if element is _END:  # others still have data: a 0-row batch, as in TensorFlow
            element = _from_spec(_spec(self._template))
            if self._gpu is not None:
                element = next(_to_gpu(iter([element]), self._gpu))
        self._steps += 1
        return _regroup(element, None, self._replica_ids)

    # the checkpoint state protocol
    def _serialize_to_tensors(self):
        return {"steps": np.array(self._steps + self._replay, dtype=np.int64)}

    def _restore_from_tensors(self, tensors):
        target = int(tensors["steps"])
        if target < self._steps:
            raise ValueError(f"cannot restore a dataset iterator at step {target} into one "
                             f"already at step {self._steps}: restore into a fresh iterator")
        self._replay = target - self._steps


class _Prepared(tuple):
    """``(components, device arrays per leaf)`` made by the prefetch thread."""


def _staged(local: Iterator[tuple], stage: Callable) -> Iterator[_Prepared]:
    for components in local:
        columns = zip(*[nest.flatten(c) for c in components])
        yield _Prepared((components, [stage(parts) for parts in columns]))


def _regroup(components: tuple, device_arrays, replica_ids) -> Any:
    """One component per local replica -> the batch's structure with ``PerReplica`` leaves
    (a ``(features, labels)`` batch unpacks into two ``PerReplica``, as in TensorFlow)."""
    columns = list(zip(*[nest.flatten(c) for c in components]))
    values = [PerReplica(parts, replica_ids) for parts in columns]
    for value, array in zip(values, device_arrays or ()):
        value._device_array = array
    if not isinstance(components[0], (dict, list, tuple)):
        return values[0]
    return nest.pack_sequence_as(components[0], values)


class _Spec:
    """The inner shape and dtype of one component (a leaf for ``nest``; picklable)."""

    def __init__(self, x):
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # CuPy: no host copy
        self.inner, self.dtype = tuple(np.shape(x)[1:]), np.dtype(dtype).str

    def empty(self) -> np.ndarray:
        return np.empty((0,) + tuple(self.inner), np.dtype(self.dtype))


def _spec(components):
    return tuple(nest.map_structure(_Spec, c) for c in components)


def _from_spec(spec):
    return tuple(nest.map_structure(lambda s: s.empty(), c) for c in spec)


_END = object()


def _gpu_of(strategy):
    """The GPU ordinal of this rank's replica when batches should go there, else ``None``."""
    devices = strategy.extended.worker_devices
    if not devices or "GPU:" not in devices[0]:
        return None
    from mpistrat.runtime.devices import cupy_available
    if not cupy_available():
        return None
    return int(devices[0].rsplit("GPU:", 1)[1])


def _to_gpu(local: Iterator[tuple], device: int) -> Iterator[tuple]:
    """Each component's leaves as CuPy arrays on ``device``, copied on a stream of its own
    (this runs in the prefetch thread; the stream is synchronised before the batch is handed
    over, so the step sees complete data)."""
    import cupy
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        for components in local:
            with stream:
                moved = tuple(nest.map_structure(cupy.asarray, c) for c in components)
            stream.synchronize()
            yield moved


def distribute_dataset(strategy, dataset: Dataset, options=None) -> DistributedDataset:
    """``strategy.experimental_distribute_dataset``: see the module docstring."""
    if not isinstance(dataset, Dataset):
        raise ValueError(f"experimental_distribute_dataset needs an ms.data.Dataset, got "
                         f"{type(dataset).__name__}")
    if dataset._batch_size is None:
        raise ValueError("experimental_distribute_dataset needs a batched dataset: call "
                         ".batch(global_batch_size) before distributing it")
    policy = dataset.options().experimental_distribute.auto_shard_policy
    replicas, replica = strategy.extended.engine.size, strategy.extended.engine.rank  # ranks
    pieces = len(strategy.extended.local_replica_ids)
    if strategy.extended.experimental_require_static_shapes:
        _check_static(dataset, strategy.num_replicas_in_sync)
    files = dataset.source.files if isinstance(dataset, BatchedRecords) else None
    if policy is AutoShardPolicy.AUTO and files is not None and len(files) >= replicas:
        policy = AutoShardPolicy.FILE
    if files is not None and hasattr(dataset.source, "prepare_shards"):  # TFRecord indexes
        dataset.source.prepare_shards(strategy.extended.engine, policy)
    if policy is AutoShardPolicy.FILE:
        if files is None:
            raise ValueError("AutoShardPolicy.FILE needs a file-based dataset (a reader "
                             "followed by .batch); this one is built in memory: use DATA or AUTO")
        if len(files) < replicas:
            raise ValueError(f"AutoShardPolicy.FILE deals files to ranks, but there are "
                             f"{len(files)} files for {replicas} ranks: use fewer ranks, more "
                             f"files, or AutoShardPolicy.DATA")
        return _distributed(strategy, pieces, lambda: _file_shard(dataset, replicas, replica),
                            options)
    if files is not None and policy is not AutoShardPolicy.OFF:
        return _distributed(strategy, pieces,
                            lambda: _data_shard_reads(dataset, replicas, replica), options)

    def local_batches():
        for batch in dataset:
            slices = rebatch_slices(_rows(batch), replicas)
            if policy is AutoShardPolicy.OFF:
                for start, stop in slices:   # every replica step of the global batch
                    yield _slice(batch, start, stop)
            else:                            # DATA / AUTO: this replica's slice
                yield _slice(batch, *slices[replica])

    return _distributed(strategy, pieces, local_batches, options)


def _check_static(dataset: Dataset, replicas: int) -> None:
    """Static shapes (TPUStrategy): full batches only, evenly split over the replicas."""
    if not dataset._drop_remainder:
        raise ValueError(
            "this strategy needs static shapes (as TPUs do), but the dataset's last batch can "
            "be short: batch it with .batch(global_batch_size, drop_remainder=True)")
    if dataset._batch_size % replicas:
        raise ValueError(
            f"the global batch size ({dataset._batch_size}) is not divisible by "
            f"num_replicas_in_sync ({replicas}); static shapes need equal per-replica batches")


def _distributed(strategy, pieces: int, make_batches, options) -> DistributedDataset:
    """Cut each rank batch into ``pieces`` equal per-replica components."""
    if pieces == 1:
        return DistributedDataset(strategy, lambda: ((b,) for b in make_batches()), options)

    def split():
        for batch in make_batches():
            rows = _rows(batch) // pieces
            yield tuple(_slice(batch, i * rows, (i + 1) * rows) for i in range(pieces))

    return DistributedDataset(strategy, split, options)


def _data_shard_reads(dataset: BatchedRecords, replicas: int, replica: int):
    """DATA sharding of a reader: read only this replica's rows of every global batch."""
    for start, stop in dataset.batch_bounds():
        a, b = rebatch_slices(stop - start, replicas)[replica]
        yield dataset.source.read_rows(start + a, start + b)


def _file_shard(dataset: BatchedRecords, replicas: int, replica: int):
    """FILE sharding: files replica, replica + N, ... cut into batches of ceil(G / N) rows."""
    source = dataset.source
    per_replica = -(-dataset._batch_size // replicas)
    mine = list(range(replica, len(source.files), replicas))
    pending = []
    held = 0
    for index in mine:
        for first in range(0, source.counts[index], per_replica):
            block = source.read_file_rows(index, first, min(first + per_replica,
                                                            source.counts[index]))
            pending.append(block)
            held += len(block)
            while held >= per_replica:
                joined = np.concatenate(pending)
                yield joined[:per_replica]
                pending, held = [joined[per_replica:]], held - per_replica
    if held and not dataset._drop_remainder:
        yield np.concatenate(pending)


def distribute_datasets_from_function(strategy, dataset_fn: Callable, options=None):
    """``strategy.distribute_datasets_from_function``: ``dataset_fn(InputContext)`` per rank."""
    engine = strategy.extended.engine
    context = InputContext(num_input_pipelines=engine.size, input_pipeline_id=engine.rank,
                           num_replicas_in_sync=strategy.num_replicas_in_sync)
    dataset = dataset_fn(context)
    pieces = len(strategy.extended.local_replica_ids)
    if (strategy.extended.experimental_require_static_shapes and isinstance(dataset, Dataset)
            and dataset._batch_size is not None and not dataset._drop_remainder):
        raise ValueError(
            "this strategy needs static shapes (as TPUs do), but the dataset_fn's dataset can "
            "end with a short batch: use .batch(per_replica_batch_size, drop_remainder=True)")

    def groups():  # each local replica takes one element per step; a partial group ends it
        iterator = iter(dataset)
        while True:
            group = tuple(next(iterator, _END) for _ in range(pieces))
            if any(x is _END for x in group):
                return
            yield group

    return DistributedDataset(strategy, groups, options)


register_input_distribution(distribute_dataset, distribute_datasets_from_function)
