"""Datasets distributed over the replicas: rebatching, auto-sharding, lockstep, positions.

``distribute_dataset(strategy, dataset)`` follows TensorFlow's
``MultiWorkerMirroredStrategy`` with one replica per worker (DESIGN.md section 2);
``layouts.py`` says which rows each rank yields per policy:

* ``DATA`` (and ``AUTO`` unless the dataset is a reader batched with at least as
  many files as ranks): the rebatch slice of every global batch. Over a
  random-access pipeline a rank computes which records its rows are, reads
  only those and maps only those; otherwise it walks the global batches.
* ``FILE``: rank r reads files r, r+N, ... in batches of ``ceil(G / N)`` rows.
* ``OFF``: every slice of every global batch on every rank.

When the dataset is distributed the ranks agree (collectively, within the
collective timeout) on what they read and on one seed: every file's size and
modification time (a rank that sees another copy raises on every rank, naming
it), and the seed of every unseeded shuffle, so no row is duplicated or lost.

For every step the ranks agree whether any of them still has data and whether
one failed to read: all ranks stop on the same step, a read failure raises on
every rank at the step that failed, and a rank that ran dry meanwhile yields
0-row batches of the right dtype and inner shape (as TensorFlow does). They
agree a window of up to 16 steps at a time, read ahead, with one small
all-reduce (``lockstep.py``), so ranks meet at most every few steps; where reading
ahead could change what the user sees (a pipeline without random access, batches
fetched to a device) they meet at every step.

*Positions.* An iterator's position is (epoch, step, seed); ``ms.Checkpoint``
saves it. A restore into any iterator of the same dataset continues the exact
sequence of global batches an uninterrupted run would have seen: at any width
under ``DATA`` (OFF: at a global batch boundary; FILE and
``distribute_datasets_from_function``: at the same width, else a ``ValueError``
naming the policy). Random-access pipelines seek (the cost does not depend on
the position); others replay the steps before it, with a warning. The state also
carries the pipeline's fingerprint (``fingerprint.py``: source rows, files, global
batch, shuffle seeds, ordering operations): a restore into a pipeline that differs
in any of them raises a ``ValueError`` naming what changed, on every rank, rather
than skip or repeat rows.

*Caches.* The state also carries what the pipeline's ``cache()`` holds on each rank (as
tf.data's iterator checkpoint carries its memory cache): every rank's rows, gathered into
one value (a checkpoint saves each value once), at most ``cache_state.LIMIT_BYTES`` in all
(beyond it the save is refused, on every rank, naming the limit). A restore at the same width
gives each rank its own rows back, so the rows computed before the save are yielded again bit
for bit, even by a map that is not deterministic. At another width (DATA, OFF) every rank
takes the rows of all saved ranks, which is exact where they agree; where two ranks hold
different values for one row (a map below the cache that is not deterministic), or a cached
batch is held only in part, the restore raises a ``ValueError`` on every rank naming the
row, rather than yield values the saved ranks would not have.

With several replicas per rank (``TPUStrategy``: one per JAX device) the rank is
the unit of sharding and its batch is cut into equal per-device pieces; static
shapes are required (``.batch(G, drop_remainder=True)``, ``G`` divisible by
``num_replicas_in_sync``) and the ranks stop on the first step where any rank
has no full batch. Batches are fetched to the devices (TPU devices, or this
rank's GPU with CuPy) ahead of the step on a thread
(``InputOptions.experimental_fetch_to_device``, ``experimental_per_replica_buffer_size``).
"""

import pickle
import secrets
import warnings
from typing import Any, Callable, Iterator, Optional

import numpy as np

from mpistrat.collectives.agreement import Failure, agree_errors, agree_view
from mpistrat.data import cache_state, layouts, ops, shuffles
from mpistrat.data.cache import Cache
from mpistrat.data.dataset import Dataset, TensorSpec
from mpistrat.data.experimental import Optional as OptionalValue
from mpistrat.data.fingerprint import changed_parts, pipeline_parts
from mpistrat.data.options import AutoShardPolicy
from mpistrat.data.permutation import derive_key
from mpistrat.data.readers import view_of
from mpistrat.data.threads import prefetched
from mpistrat.distribute.context import InputContext
from mpistrat.distribute.options import InputOptions
from mpistrat.distribute.lockstep import Lockstep
from mpistrat.distribute.input_staging import (Prepared, empty_like, gpu_of, regroup, spec_of,
                                               staged, to_gpu)
from mpistrat.errors import DataLossError, InvalidArgumentError, OutOfRangeError
from mpistrat.runtime import timeline

__all__ = ["DistributedDataset", "DistributedIterator", "distribute_dataset",
           "distribute_datasets_from_function"]

POLICY_CODES = {"OFF": -1, "DATA": 2, "FILE": 1, "FUNCTION": 10}
_END = object()


class DistributedDataset:
    """Iterable of ``PerReplica`` batches, in lockstep over all ranks; each ``iter()`` is
    the next epoch."""

    def __init__(self, strategy, layout, options=None, seed: int = 0, spec_source=None):
        self._strategy, self._layout, self._options = strategy, layout, options
        self._seed = seed          # agreed by the ranks: seeds every unseeded shuffle
        self._epochs = 0
        self._spec_source = spec_source

    def __iter__(self) -> "DistributedIterator":
        epoch, self._epochs = self._epochs, self._epochs + 1
        return DistributedIterator(self, epoch)

    @property
    def element_spec(self) -> Any:
        """The ``TensorSpec`` of one replica's batch (batch dimension ``None`` unless static)."""
        spec = self._spec_source.element_spec
        extended = self._strategy.extended
        if extended.experimental_require_static_shapes and self._spec_source._batch_size:
            rows = self._spec_source._batch_size // self._strategy.num_replicas_in_sync
            return _with_rows(spec, rows)
        return spec


def _with_rows(spec, rows):
    from mpistrat import nest
    return nest.map_structure(lambda s: TensorSpec((rows,) + tuple(s.shape[1:]), s.dtype), spec)


class DistributedIterator:
    """Yields ``PerReplica`` batches in lockstep; ``ms.Checkpoint(iterator=it)`` saves its
    position (see the module docstring)."""

    def __init__(self, dataset: DistributedDataset, epoch: int):
        strategy = dataset._strategy
        self._dataset, self._layout = dataset, dataset._layout
        self._engine = strategy.extended.engine
        self._replica_ids = strategy.extended.local_replica_ids
        self._pieces = len(self._replica_ids)
        self._static = strategy.extended.experimental_require_static_shapes
        self._stage = getattr(strategy.extended, "stage_per_replica", None)
        self._default_depth = getattr(strategy.extended, "default_prefetch_depth", 0)
        self._options = dataset._options or InputOptions()
        self._gpu = gpu_of(strategy) if self._options.experimental_fetch_to_device is not False \
            and self._stage is None else None
        self._epoch, self._seed = epoch, dataset._seed
        self._steps = 0
        self._local = None          # opened at the first step (a restore may move it first)
        self._template = None       # the last batch seen: the model for 0-row batches
        self._seen = False          # whether this rank read a batch (for the layout flag)
        self._shared = False        # whether the ranks shared a layout (at most once)
        self._parts = None          # the pipeline's fingerprint (_fingerprint)
        # windows of steps read ahead only where reading ahead changes nothing the user sees:
        # a random-access pipeline (its elements a function of their position: not a
        # generator that waits on the training loop, nor a sequential cache() completed by
        # reading its end), on the host (device buffers keep their own depth), between ranks
        self._lockstep = Lockstep(self._next_local, self._flags, self._counted, _END,
                                  grow=self._engine.size > 1 and self._gpu is None and
                                  self._stage is None and
                                  getattr(self._layout, "random_access", False))

    # -- the stream of this rank's steps ---------------------------------------------------
    def _iteration(self) -> ops.Iteration:
        return ops.Iteration((self._epoch,), seeds_for(self._layout, self._seed))

    def _open(self) -> Iterator:
        local = self._layout.local_steps(self._iteration(), self._steps)
        if not isinstance(self._layout, layouts.FunctionLayout):
            local = (x if x is layouts.NO_LAYOUT else layouts.split_pieces(x, self._pieces)
                     for x in local)
        depth = getattr(self._layout, "depth", 0)
        if depth and self._layout.random_access:   # reads and maps overlap the step
            local = prefetched(local, depth)
        options = self._options
        if self._gpu is not None:  # GPU replicas: copy the next batch while this step runs
            depth = options.experimental_per_replica_buffer_size
            moved = to_gpu(local, self._gpu)
            local = prefetched(moved, 1 if depth is None else depth) if depth != 0 else moved
        if self._stage is not None and options.experimental_fetch_to_device is not False:
            depth = options.experimental_per_replica_buffer_size
            depth = self._default_depth if depth is None else depth
            local = staged(local, self._stage)
            local = prefetched(local, depth) if depth > 0 else local
        return iter(local)

    def _close(self) -> None:
        self._lockstep.clear()
        if self._local is not None and hasattr(self._local, "close"):
            self._local.close()
        self._local = None

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        if timeline.ON:
            with timeline.span("dataset step", "data", step=self._steps):
                return self._step()
        return self._step()

    def get_next(self) -> Any:
        """The next step's value; ``ms.errors.OutOfRangeError`` past the end (on every rank
        at the same step), as tf.data's ``get_next``."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence: the distributed iterator has no step "
                                  f"left after {self._steps} (get_next_as_optional() "
                                  f"tests for the end instead)") from None

    def get_next_as_optional(self) -> OptionalValue:
        """The next batch as an ``Optional``: empty on every rank at the same step at the end."""
        try:
            return OptionalValue.from_value(next(self))
        except StopIteration:
            return OptionalValue.empty(self.element_spec)

    @property
    def element_spec(self) -> Any:
        return self._dataset.element_spec

    def _next_local(self):
        """This rank's next step (or ``_END``) and its failure, if reading it failed."""
        try:
            if self._local is None:
                self._local = self._open()
            return next(self._local, _END), None
        except Exception as err:  # noqa: BLE001 - agreed with the other ranks, then raised
            return _END, Failure(err, self._engine.rank, "reading its input")

    def _counted(self, flags: list):
        """How many ranks raise each flag: a float SUM over ranks (one collective, inside the
        validation probe); one rank counts its own flags without a collective."""
        return flags if self._engine.size == 1 else self._engine.count_ranks(flags)

    def _flags(self, element, failure) -> list:
        """This rank's flags for a step it read (ahead: ``lockstep.py``): static shapes,
        whether it has no batch and whether it failed; else whether it has data, whether it
        needs the batch layout (no batch yet) and whether it failed."""
        if self._static:
            return [element is _END, failure is not None]
        blank = element is _END or element is layouts.NO_LAYOUT
        self._seen = self._seen or not (blank or isinstance(element, Prepared))
        return [element is not _END, blank and not self._seen and self._template is None,
                failure is not None]

    def _step(self) -> Any:
        element, failure, flags = self._lockstep.next()   # flags: counted over the ranks
        if self._static:  # full batches only: stop when any rank has none left
            if flags[1]:
                agree_errors(self._engine, failure, f"input step {self._steps}")
            if flags[0]:
                raise StopIteration
            self._steps += 1
            return regroup(*element, self._replica_ids) if isinstance(element, Prepared) \
                else regroup(element, None, self._replica_ids)
        blank = element is _END or element is layouts.NO_LAYOUT
        if not blank and not isinstance(element, Prepared):
            self._template = element
        if flags[2]:  # a rank could not read (a truncated file, say): every rank raises
            agree_errors(self._engine, failure, f"input step {self._steps}")
        if not flags[0]:
            raise StopIteration  # no rank has data left: everyone stops on this step
        if flags[1] and not self._shared:  # a rank that never had data learns the layout
            self._shared = True            # from one that did (then every rank has one)
            spec = share_layout(self._engine, None if self._template is None
                                else spec_of(self._template))
            if self._template is None:
                self._template = empty_like(spec)
        if blank:  # others still have data: a 0-row batch, as in TensorFlow
            element = empty_like(spec_of(self._template))
            if self._gpu is not None:
                element = next(to_gpu(iter([element]), self._gpu))
        self._steps += 1
        if isinstance(element, Prepared):
            return regroup(*element, self._replica_ids)
        return regroup(element, None, self._replica_ids)

    # -- the checkpoint state protocol -------------------------------------------------------
    def _optional_tensors(self) -> frozenset:
        """State keys a checkpoint may lack (saved before they existed): not missing there."""
        return frozenset([f"pipeline_{part}" for part in self._fingerprint()] + ["cache"])

    def _fingerprint(self) -> dict:
        """This pipeline's ``fingerprint.pipeline_parts``, made once (the pipeline is fixed)."""
        if self._parts is None:   # (per-rank pipelines differ by design: none for them)
            node = None if self._layout.policy == "FUNCTION" else _node_of(self._layout)
            self._parts = pipeline_parts(node) if node is not None else {}
        return self._parts

    def _serialize_to_tensors(self):
        state = {"epoch": np.array(self._epoch, np.int64),
                 "steps": np.array(self._steps, np.int64),
                 "seed": np.array(self._seed, np.int64),
                 "replicas": np.array(self._engine.size, np.int64),
                 "policy": np.array(POLICY_CODES[self._layout.policy], np.int64)}
        for part, value in self._fingerprint().items():
            state[f"pipeline_{part}"] = np.array(value, np.int64)
        # what the caches hold; per-rank pipelines always carry it, so that every rank
        # saves the same keys whichever of them has a cache
        if self._layout.policy == "FUNCTION" or self._caches():
            state["cache"] = _CacheValue(self)
        return state

    def _caches(self) -> list:
        """The ``cache()`` nodes of this rank's pipeline, in a fixed order."""
        node = _node_of(self._layout)
        return [] if node is None else [n for n in ops.walk(node) if isinstance(n, Cache)]

    def _gathered_caches(self) -> np.ndarray:
        """What every rank's caches hold, one value for all (collective: read only when a
        checkpoint writes its values, on every rank at once; see ``_CacheValue``)."""
        engine, what = self._engine, "saving the cache() contents of a dataset iterator"
        section = b""
        with engine.agreed(what, hint="keep the iterator out of the checkpoint (its input "
                                      "then starts the epoch afresh)"):
            section = cache_state.encode_section([c.contents() for c in self._caches()])
        sizes = engine.all_gather(np.array([len(section)], np.int64)).tolist()
        if sum(sizes) > cache_state.LIMIT_BYTES:
            held = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
            raise ValueError(
                f"{what} failed: the cache() of its pipeline holds {sum(sizes)} bytes over "
                f"{len(sizes)} rank{'s' if len(sizes) > 1 else ''} ({held}), more than the "
                f"{cache_state.LIMIT_BYTES} a checkpoint saves with an iterator "
                f"(mpistrat.data.cache_state.LIMIT_BYTES). "
                f"Raise that limit, write the prepared rows once (np.save, HDF5) and read them "
                f"with ms.data.NpyDataset or ms.data.HDF5Dataset instead of cache(), or keep "
                f"the iterator out of the checkpoint")
        data = engine.all_gather(np.frombuffer(section, np.uint8).copy())
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        return cache_state.join_sections([data[a:b].tobytes()
                                          for a, b in zip(bounds, bounds[1:])])

    def _restored_caches(self, value, saved_ranks: int) -> list:
        """What each cache of this rank's pipeline holds after the restore of ``value``: this
        rank's own at the width it was saved at, else all ranks' joined; a ``ValueError``
        (the same on every rank: each reads every rank's section) where they cannot be."""
        ranks, held = self._engine.size, []
        sections = cache_state.split_sections(value)
        if len(sections) != saved_ranks:
            raise DataLossError(f"the saved cache() contents of a dataset iterator hold "
                                f"{len(sections)} ranks' sections, saved at {saved_ranks} ranks")
        if saved_ranks == ranks:     # every section is read: a damaged one fails every rank
            for rank, section in enumerate(sections):
                found = cache_state.decode_section(section)
                held = found if rank == self._engine.rank else held
        else:
            try:
                held = cache_state.merge([cache_state.decode_section(s) for s in sections])
            except ValueError as err:
                raise ValueError(
                    f"cannot resume this dataset iterator at {ranks} rank"
                    f"{'s' if ranks > 1 else ''}: it was saved at "
                    f"{saved_ranks} ranks with what the cache() of its pipeline held on each "
                    f"rank, and {err} (a map below the cache that is not deterministic, such "
                    f"as a random generator without a seed, computes each rank's rows anew): "
                    f"the ranks of another width cannot go on as the saved ones would have. "
                    f"Resume at {saved_ranks} ranks, or restore without the iterator (leave "
                    f"it out of the Checkpoint) to start its input afresh") from None
        caches = self._caches()
        if len(held) != len(caches):
            raise ValueError(f"cannot resume this dataset iterator: it was saved with what "
                             f"{len(held)} cache() of its pipeline held, and this pipeline has "
                             f"{len(caches)}. Build the pipeline as it was when saved, or "
                             f"restore without the iterator to start its input afresh")
        return held

    def _restore_from_tensors(self, tensors):
        steps = int(tensors["steps"])
        if "epoch" in tensors:        # (older checkpoints hold the step count alone)
            saved = {code: name for name, code in POLICY_CODES.items()}.get(
                int(tensors["policy"]), str(int(tensors["policy"])))
            ranks = int(tensors["replicas"])
            if saved != self._layout.policy:
                raise ValueError(
                    f"this iterator was saved under {_policy_text(saved)} at {ranks} ranks, but "
                    f"at {self._engine.size} ranks the dataset is sharded by "
                    f"{_policy_text(self._layout.policy)}: its position does not carry over; "
                    f"set options.experimental_distribute.auto_shard_policy explicitly")
        saved_parts = {key[len("pipeline_"):]: int(value) for key, value in tensors.items()
                       if key.startswith("pipeline_")}   # (none in checkpoints before them)
        changes = changed_parts(saved_parts, self._fingerprint())
        if changes:
            raise ValueError(
                f"cannot resume this dataset iterator: its pipeline differs from the one whose "
                f"position was saved, in {'; '.join(changes)}. Resuming would skip or repeat "
                f"rows. Build the pipeline as it was when saved, or restore without the "
                f"iterator (leave it out of the Checkpoint) to start its input afresh")
        if "epoch" in tensors:
            steps = layouts.resume_step(saved, steps, ranks, self._engine.size)
        held = None     # (none in checkpoints from before caches were saved: as they are)
        if "cache" in tensors:
            held = self._restored_caches(tensors["cache"], ranks if "epoch" in tensors
                                         else self._engine.size)
        if "epoch" in tensors:
            self._epoch, self._seed = int(tensors["epoch"]), int(tensors["seed"])
            self._dataset._epochs = self._epoch + 1
            self._dataset._seed = self._seed
        self._close()
        for cache, contents in zip(self._caches(), held or ()):
            cache.load(contents)
        self._steps, self._template = steps, None
        self._seen = self._shared = False
        if steps and not self._layout.random_access and self._engine.rank == 0:
            warnings.warn(f"the restored dataset iterator replays {steps} steps: its pipeline "
                          f"has no random access ({_blocker_of(self._layout)}), so its position "
                          f"is found by reading again; a random-access pipeline (see "
                          f"ms.data.Dataset) seeks directly", stacklevel=2)


class _CacheValue:
    """The ``cache`` value of an iterator's state, gathered from every rank only when NumPy
    reads it (``np.asarray``): a checkpoint reads its values on every rank at once, in one
    order, when it writes them. Listing the state's keys (a restore, a rank attaching objects
    to a checkpoint alone) gathers nothing."""

    def __init__(self, iterator: "DistributedIterator"):
        self._iterator = iterator

    def __array__(self, dtype=None, copy=None):
        value = self._iterator._gathered_caches()
        return value if dtype is None else value.astype(dtype)


def _policy_text(policy: str) -> str:
    return "distribute_datasets_from_function" if policy == "FUNCTION" else \
        f"AutoShardPolicy.{policy}"


def _node_of(layout) -> Optional[ops.Node]:
    """The root of the pipeline a layout reads (this rank's, for per-rank datasets)."""
    return getattr(layout, "node", None) or getattr(getattr(layout, "dataset", None), "_node",
                                                    None)


def _blocker_of(layout) -> str:
    node = _node_of(layout)
    return (node.blocker() if node is not None else None) or "per-rank datasets"


def seeds_for(layout, base: int) -> dict:
    """A seed for each unseeded shuffle of the pipeline, derived from the agreed ``base``."""
    node = _node_of(layout)
    if node is None:
        return {}
    randoms = [n for n in ops.walk(node) if isinstance(n, shuffles.Random) and n.seed is None]
    return {id(n): derive_key(base, (k,)) for k, n in enumerate(randoms)}


def share_layout(engine, spec) -> Any:
    """The batch layout of the lowest rank that has one, for every rank (timed collectives)."""
    candidate = engine.rank if spec is not None else engine.size
    donor = -int(engine.all_reduce(np.array([-candidate], np.int64), "MAX")[0])
    blob = pickle.dumps(spec) if engine.rank == donor else b""
    length = int(engine.broadcast(np.array([len(blob)], np.int64), root=donor)[0])
    data = np.frombuffer(blob, np.uint8).copy() if engine.rank == donor else \
        np.empty(length, np.uint8)
    return pickle.loads(engine.broadcast(data, root=donor).tobytes())  # our own ranks' bytes


def _agree(strategy, node: ops.Node) -> int:
    """The ranks agree on the files (sizes and modification times, as each rank saw them
    when the dataset was built and as it sees them now) and on one seed; a file that changed
    since the dataset was built is refused on every rank (the agreed views say so alike)."""
    engine = strategy.extended.engine
    readers = layouts.readers_in(node)
    views = [(reader.views, [view_of(path) for path in reader.files]) for reader in readers]
    if views:
        views = agree_view(engine, views, "the files of a distributed dataset (path, size, "
                                          "modification time: when built, now)",
                           error=InvalidArgumentError,
                           hint="every rank must read the same files: put them on a file "
                                "system that every rank shares, or give node-local copies the "
                                "same size and modification time (cp -p, rsync -t)")
        for built, now in views:
            for then, current in zip(built, now):
                if then != current:
                    raise InvalidArgumentError(
                        f"{then[0]} changed after its dataset was built (then {then[1:]}, now "
                        f"{current[1:]}, size and modification time in ns): build the dataset "
                        f"again after the file is complete")
    drawn = np.array([secrets.randbits(62)], np.int64)
    return int(engine.broadcast(drawn, root=0)[0])


def distribute_dataset(strategy, dataset: Dataset, options=None) -> DistributedDataset:
    """``strategy.experimental_distribute_dataset``: see the module docstring."""
    if not isinstance(dataset, Dataset):
        raise ValueError(f"experimental_distribute_dataset needs an ms.data.Dataset, got "
                         f"{type(dataset).__name__}")
    if dataset._batch_size is None:
        raise ValueError("experimental_distribute_dataset needs a batched dataset: call "
                         ".batch(global_batch_size) before distributing it")
    policy = dataset.options().experimental_distribute.auto_shard_policy
    ranks, rank = strategy.extended.engine.size, strategy.extended.engine.rank
    if strategy.extended.experimental_require_static_shapes:
        _check_static(dataset, strategy.num_replicas_in_sync)
    node = dataset._node
    reader, batch = layouts.file_reader_batch(node)
    if policy is AutoShardPolicy.AUTO and reader is not None and len(reader.files) >= ranks:
        policy = AutoShardPolicy.FILE
    seed = _agree(strategy, node)               # the files every rank reads, and a seed
    for source in layouts.readers_in(node):     # TFRecord files: indexed once, shared
        if hasattr(source, "prepare_shards"):
            source.prepare_shards(strategy.extended.engine,
                                  policy if source is reader else AutoShardPolicy.DATA)
    if policy is AutoShardPolicy.FILE:
        if reader is None:
            raise ValueError("AutoShardPolicy.FILE needs a file-based dataset (a reader "
                             "followed by .batch); this one is built in memory: use DATA or AUTO")
        if len(reader.files) < ranks:
            raise ValueError(f"AutoShardPolicy.FILE deals files to ranks, but there are "
                             f"{len(reader.files)} files for {ranks} ranks: use fewer ranks, more "
                             f"files, or AutoShardPolicy.DATA")
        layout = layouts.FileLayout(reader, batch.batch_size, batch.drop_remainder, ranks, rank)
    elif policy is AutoShardPolicy.OFF:
        layout = layouts.OffLayout(node, ranks, rank)
    else:
        layout = layouts.DataLayout(node, ranks, rank)
    layout.depth = layouts.prefetch_depth(node)
    return DistributedDataset(strategy, layout, options, seed, dataset)


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
    if not isinstance(dataset, Dataset):
        raise ValueError(f"dataset_fn must return an ms.data.Dataset, got "
                         f"{type(dataset).__name__}")
    layout = layouts.FunctionLayout(dataset, pieces)
    seed = int(engine.broadcast(np.array([secrets.randbits(62)], np.int64), root=0)[0])
    return DistributedDataset(strategy, layout, options, seed, dataset)

