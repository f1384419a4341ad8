"""Datasets distributed over the replicas: rebatching, auto-sharding, lockstep ends.

``distribute_dataset(strategy, dataset)`` follows TensorFlow's
``MultiWorkerMirroredStrategy`` with one replica per worker (DESIGN.md section 2):

* ``DATA`` (and ``AUTO`` for these in-memory sources): every rank walks the
  global batches and keeps its rebatch slice (``rebatch_slices``).
* ``OFF``: no sharding; every rank yields all N slices of every global batch,
  one per step, so data is duplicated across ranks as in TensorFlow.

Every step, the ranks agree with a MIN all-reduce whether all of them still
have data: all ranks stop on the same step, never one rank running dry alone.
Iterating yields ``PerReplica`` values for ``strategy.run``.
"""

from typing import Any, Callable, Iterator

import numpy as np

from mpistrat import nest
from mpistrat.collectives import ReduceOp
from mpistrat.data.dataset import Dataset
from mpistrat.data.options import AutoShardPolicy
from mpistrat.data.rebatch import rebatch_slices
from mpistrat.distribute.context import InputContext
from mpistrat.distribute.strategy import register_input_distribution
from mpistrat.distribute.values import PerReplica

__all__ = ["DistributedDataset", "distribute_dataset", "distribute_datasets_from_function"]


def _rows(batch: Any) -> int:
    leaves = nest.flatten(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def _slice(batch: Any, start: int, stop: int) -> Any:
    return nest.map_structure(lambda leaf: np.asarray(leaf)[start:stop], batch)


class DistributedDataset:
    """Iterable of ``PerReplica`` batches, in lockstep over all ranks."""

    def __init__(self, strategy, make_local: Callable[[], Iterator[Any]]):
        self._strategy = strategy
        self._make_local = make_local

    def __iter__(self) -> Iterator[PerReplica]:
        engine = self._strategy.extended.engine
        replica_ids = self._strategy.extended.local_replica_ids
        local = iter(self._make_local())
        while True:
            element = next(local, _END)
            have = np.array([0 if element is _END else 1], dtype=np.int32)
            if int(engine.all_reduce(have, ReduceOp.MIN)[0]) == 0:
                return  # some rank ran out: everyone stops on this step
            yield PerReplica((element,), replica_ids)


_END = object()


def distribute_dataset(strategy, dataset: Dataset, options=None) -> DistributedDataset:
    """``strategy.experimental_distribute_dataset``: see the module docstring."""
    if not isinstance(dataset, Dataset):
        raise ValueError(f"experimental_distribute_dataset needs an ms.data.Dataset, got "
                         f"{type(dataset).__name__}")
    if dataset._batch_size is None:
        raise ValueError("experimental_distribute_dataset needs a batched dataset: call "
                         ".batch(global_batch_size) before distributing it")
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy is AutoShardPolicy.FILE:
        raise ValueError("AutoShardPolicy.FILE needs a file-based dataset; this one is built "
                         "in memory: use DATA or AUTO")
    replicas = strategy.num_replicas_in_sync
    replica = strategy.extended.local_replica_ids[0]

    def local_batches():
        for batch in dataset:
            slices = rebatch_slices(_rows(batch), replicas)
            if policy is AutoShardPolicy.OFF:
                for start, stop in slices:   # every replica step of the global batch
                    yield _slice(batch, start, stop)
            else:                            # DATA / AUTO: this replica's slice
                yield _slice(batch, *slices[replica])

    return DistributedDataset(strategy, local_batches)


def distribute_datasets_from_function(strategy, dataset_fn: Callable, options=None):
    """``strategy.distribute_datasets_from_function``: ``dataset_fn(InputContext)`` per rank."""
    context = InputContext(num_input_pipelines=strategy.num_replicas_in_sync,
                           input_pipeline_id=strategy.extended.local_replica_ids[0],
                           num_replicas_in_sync=strategy.num_replicas_in_sync)
    dataset = dataset_fn(context)
    return DistributedDataset(strategy, lambda: iter(dataset))


register_input_distribution(distribute_dataset, distribute_datasets_from_function)
