"""Random-access datasets distributed at 1-4 ranks: the global batch sequence is the one a single
process sees (digest per step), every row once per epoch for each policy, bytes read per rank,
unseeded shuffles agreed, a resume at a step, the end of data as an Optional, bfloat16."""

import contextlib
import hashlib
import os

import ml_dtypes
import numpy as np
import pytest

import mpistrat as ms
from mpistrat import nest
from mpistrat.data import AutoShardPolicy, Dataset, FixedLengthRecordDataset, Options

RECORD = 16   # bytes: 4 int32 values per record, the first one the record's number


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("global")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def records(world, directory, files=4, per_file=37):
    """Files of records ``[i, 2i, 3i, 4i]`` (int32), numbered across the files."""
    paths = [os.path.join(directory, f"part-{k}.bin") for k in range(files)]
    if world.rank == 0:
        for k, path in enumerate(paths):
            first = np.arange(k * per_file, (k + 1) * per_file, dtype=np.int32)
            np.stack([first, 2 * first, 3 * first, 4 * first], axis=1).tofile(path)
    world.comm.Barrier()
    return paths


def reader(paths):
    return FixedLengthRecordDataset(paths, RECORD, dtype=np.int32, shape=(4,))


def with_policy(dataset, policy):
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def _local(batch):
    return nest.map_structure(lambda v: np.asarray(v.values[0]), batch)


def global_batches(world, distributed):
    """Each step's global batch: the ranks' slices joined in replica order."""
    steps = []
    for batch in distributed:
        parts = world.comm.allgather(_local(batch))
        steps.append(nest.map_structure(lambda *p: np.concatenate(p), *parts))
    return steps


def digest(steps) -> str:
    h = hashlib.sha256()
    for step in steps:
        for leaf in nest.flatten(step):
            h.update(np.ascontiguousarray(leaf).tobytes())
        h.update(b"|")
    return h.hexdigest()


def decode(rows):
    return {"number": rows[:, 0].astype(np.int64), "x": rows[:, 1:].astype(np.float32) / 2}


PIPELINES = {
    "global_shuffle-map": lambda r: r.global_shuffle(seed=7).map(decode, vectorized=True).batch(9),
    "shuffle-buffer": lambda r: r.shuffle(16, seed=3).map(decode, vectorized=True).batch(10),
    "batch-then-map": lambda r: r.global_shuffle(seed=1).batch(11).map(decode, vectorized=True),
    "zip-enumerate": lambda r: Dataset.zip((r.global_shuffle(seed=2), Dataset.range(1000)))
                                      .enumerate().batch(7),
    "per-row-map-take": lambda r: r.global_shuffle(seed=5).map(lambda x: x[0] * 10).take(100)
                                    .batch(6),
    "filter (replayed)": lambda r: r.filter(lambda x: x[0] % 3 != 1).shuffle(8, seed=4).batch(8),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_global_batches_are_those_of_one_process_at_any_width(strategy, world, shared_dir, name):
    paths = records(world, shared_dir)
    build = PIPELINES[name]
    distributed = strategy.experimental_distribute_dataset(with_policy(build(reader(paths)),
                                                                     AutoShardPolicy.DATA))
    alone = build(reader(paths))
    digests = []
    for epoch in range(2):                      # two epochs: the shuffles differ between them
        got, want = global_batches(world, distributed), list(alone)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            nest.map_structure(np.testing.assert_array_equal, g, w)
        digests.append(digest(got))
    assert digests[0] != digests[1] or "shuffle" not in name and "global" not in name
    out = os.environ.get("MPISTRAT_REPRO_DIR")    # scripts/test.sh compares widths
    if out and world.rank == 0:
        out = os.path.join(out, "data")
        os.makedirs(out, exist_ok=True)
        tag = name.split()[0]
        with open(os.path.join(out, f"data-{tag}.np{world.size}.sha256"), "w") as handle:
            handle.write(" ".join(digests) + "\n")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("policy", ["DATA", "AUTO", "OFF", "FILE"])
def test_every_row_once_per_epoch_for_each_policy(strategy, world, shared_dir, policy):
    paths = records(world, shared_dir)
    data = reader(paths)
    dataset = data.batch(10) if policy == "FILE" else data.global_shuffle(seed=9).batch(10)
    distributed = strategy.experimental_distribute_dataset(
        with_policy(dataset, getattr(AutoShardPolicy, policy)))
    for _ in range(2):
        mine = [np.asarray(b.values[0])[:, 0] for b in distributed]
        everyone = world.comm.allgather(mine)
        assert len({len(steps) for steps in everyone}) == 1            # lockstep
        if policy == "OFF":                                            # every rank sees all
            assert sorted(np.concatenate(mine).tolist()) == list(range(148))
        else:
            rows = sorted(np.concatenate([np.concatenate(s) for s in everyone]).tolist())
            assert rows == list(range(148))


@pytest.mark.mpi(min_size=1)
def test_each_rank_reads_only_its_rows(strategy, world, shared_dir):
    paths = records(world, shared_dir, files=2, per_file=500)
    data = reader(paths)
    distributed = strategy.experimental_distribute_dataset(with_policy(
        data.global_shuffle(seed=3).map(decode, vectorized=True).batch(64), AutoShardPolicy.DATA))
    kept = sum(len(b["number"].values[0]) for b in distributed)
    assert data.bytes_read == kept * RECORD                   # not one record more
    assert world.comm.allreduce(data.bytes_read) == 1000 * RECORD
    assert data.bytes_read <= 1000 * RECORD / world.size + 64 * RECORD


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how", ["shuffle", "global_shuffle"])
def test_unseeded_shuffles_are_agreed_so_no_row_is_lost(strategy, world, how):
    base = Dataset.range(300)
    dataset = (base.shuffle(50) if how == "shuffle" else base.global_shuffle()).batch(16)
    distributed = strategy.experimental_distribute_dataset(dataset)
    epochs = []
    for _ in range(2):
        mine = [int(x) for b in distributed for x in b.values[0]]
        everyone = world.comm.allgather(mine)
        assert sorted(x for rows in everyone for x in rows) == list(range(300))
        epochs.append(everyone)
    assert epochs[0] != epochs[1]                            # reshuffled each epoch


@pytest.mark.mpi(min_size=1)
def test_resume_at_a_step_continues_the_same_sequence(strategy, world, shared_dir):
    paths = records(world, shared_dir)

    def make():
        return strategy.experimental_distribute_dataset(
            reader(paths).global_shuffle().map(decode, vectorized=True).batch(9))

    first = make()
    uninterrupted = [global_batches(world, first)]            # epoch 0
    iterator = iter(first)                                    # epoch 1: 5 steps, then save
    seen = [_local(next(iterator)) for _ in range(5)]
    path = ms.Checkpoint(iterator=iterator).save(os.path.join(shared_dir, "pos"))
    rest = [_local(b) for b in iterator]
    resumed_dataset = make()                                  # another unseeded seed...
    resumed = iter(resumed_dataset)
    ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()   # ...replaced by the saved
    again = [_local(b) for b in resumed]
    assert len(again) == len(rest)
    for a, b in zip(again, rest):
        nest.map_structure(np.testing.assert_array_equal, a, b)
    numbers = [x for s in world.comm.allgather(seen + rest) for b in s for x in b["number"]]
    assert sorted(numbers) == list(range(148))
    next_epoch = [_local(b) for b in resumed_dataset]         # epoch 2 follows epoch 1
    continued = [_local(b) for b in first]
    for a, b in zip(next_epoch, continued):
        nest.map_structure(np.testing.assert_array_equal, a, b)


def _grow_first_file(world, paths, directory):
    """10 more records at the end of the first file (a file that grew between two jobs)."""
    if world.rank == 0:
        extra = np.arange(1000, 1010, dtype=np.int32)
        with open(paths[0], "ab") as f:
            np.stack([extra, extra, extra, extra], axis=1).tofile(f)
    world.comm.Barrier()
    return paths


def _add_a_file(world, paths, directory):
    """A fifth file in the list (same total rows would not hide it: the files are named)."""
    extra = os.path.join(directory, "part-extra.bin")
    if world.rank == 0:
        np.zeros((3, 4), np.int32).tofile(extra)
    world.comm.Barrier()
    return paths + [extra]


# (what changes between the saved job and the resumed one, the pipeline then, the words named)
CHANGED = {
    "batch size": (lambda w, p, d: p, lambda r: r.global_shuffle(seed=3).batch(8),
                   "the global batch size (9 when saved, 8 now)"),
    "seed": (lambda w, p, d: p, lambda r: r.global_shuffle(seed=4).batch(9), "the seed of a shuffle"),
    "grown file": (_grow_first_file, lambda r: r.global_shuffle(seed=3).batch(9),
                   "the rows of its sources (148 when saved, 158 now)"),
    "added file": (_add_a_file, lambda r: r.global_shuffle(seed=3).batch(9),
                   "the files it reads (names or sizes)"),
    "take": (lambda w, p, d: p, lambda r: r.global_shuffle(seed=3).take(100).batch(9),
             "its operations"),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("change", sorted(CHANGED))
def test_a_resume_into_a_changed_pipeline_is_refused_on_every_rank(strategy, world, shared_dir,
                                                                   change):
    """A position means the same rows only in the same pipeline: before the fingerprint, another
    batch size lost 60 of 200 rows and another seed gave 42 rows twice, silently."""
    paths = records(world, shared_dir)
    iterator = iter(strategy.experimental_distribute_dataset(
        reader(paths).global_shuffle(seed=3).batch(9)))
    for _ in range(5):
        next(iterator)
    path = ms.Checkpoint(iterator=iterator).save(os.path.join(shared_dir, "pos"))
    alter, pipeline, words = CHANGED[change]
    changed = iter(strategy.experimental_distribute_dataset(
        pipeline(reader(alter(world, paths, shared_dir)))))
    with pytest.raises(ValueError, match="cannot resume this dataset iterator") as caught:
        ms.Checkpoint(iterator=changed).restore(path)
    assert words in str(caught.value)
    assert next(changed) is not None   # the refused iterator was left at its start


@pytest.mark.mpi(min_size=1)
def test_a_resume_with_another_map_and_prefetch_continues_the_same_rows(strategy, world,
                                                                         shared_dir):
    """What changes no row's place (the map function, prefetch) does not block a resume."""
    paths = records(world, shared_dir)
    first = iter(strategy.experimental_distribute_dataset(
        reader(paths).global_shuffle(seed=3).map(decode, vectorized=True).batch(9)))
    for _ in range(5):
        next(first)
    path = ms.Checkpoint(iterator=first).save(os.path.join(shared_dir, "pos"))
    rest = [_local(b)["number"] for b in first]
    resumed = iter(strategy.experimental_distribute_dataset(
        reader(paths).global_shuffle(seed=3).map(lambda rows: rows[:, 0].astype(np.int64),
                                                  vectorized=True).batch(9).prefetch(2)))
    ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    again = [_local(b) for b in resumed]
    assert len(again) == len(rest)
    for a, b in zip(again, rest):
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=1)
def test_end_of_data_is_an_empty_optional_on_every_rank(strategy, world):
    distributed = strategy.experimental_distribute_dataset(
        Dataset.range(10).global_shuffle(seed=0).batch(4))
    spec = distributed.element_spec
    assert spec.shape == (None,) and spec.dtype == np.int64
    iterator = iter(distributed)
    found = []
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        found.append(np.asarray(optional.get_value().values[0]).tolist())
    assert world.comm.allgather(len(found)) == [3] * world.size
    assert optional.element_spec == spec
    with pytest.raises(ms.errors.InvalidArgumentError):
        optional.get_value()


@pytest.mark.mpi(min_size=1)
def test_bfloat16_survives_distribution_and_empty_slices(strategy, world):
    values = (np.arange(7, dtype=np.float32) + 0.5).astype(ml_dtypes.bfloat16)
    # a per-row map: a rank whose slice of the only batch is empty learns the layout from
    # another rank; 7 rows in batches of 5 leave ranks empty in the second step at 3-4 ranks
    dataset = Dataset.from_tensor_slices(values).map(lambda x: x * 2).batch(5)
    batches = [b.values[0] for b in strategy.experimental_distribute_dataset(dataset)]
    assert all(b.dtype == ml_dtypes.bfloat16 for b in batches)
    rows = np.concatenate(world.comm.allgather(np.concatenate(batches).astype(np.float32)))
    assert sorted(rows.tolist()) == sorted((2 * values.astype(np.float32)).tolist())
    tiny = Dataset.from_tensor_slices(values[:1]).map(lambda x: x + 1).batch(1)
    only = [b.values[0] for b in strategy.experimental_distribute_dataset(tiny)]
    assert len(only) == 1 and only[0].dtype == ml_dtypes.bfloat16
    assert only[0].shape == ((1,) if world.rank == 0 else (0,))


@pytest.mark.mpi(min_size=1)
def test_a_pipeline_without_random_access_replays_with_a_warning(strategy, world, shared_dir):
    def make():
        dataset = Dataset.range(60).filter(lambda x: x % 4 != 3).shuffle(9, seed=2).batch(5)
        return iter(strategy.experimental_distribute_dataset(dataset))

    first = make()
    for _ in range(4):
        next(first)
    path = ms.Checkpoint(iterator=first).save(os.path.join(shared_dir, "replay"))
    rest = [b.values[0].tolist() for b in first]
    resumed = make()
    with pytest.warns(UserWarning, match="replays 4 steps.*filter") if world.rank == 0 else \
            contextlib.nullcontext():
        ms.Checkpoint(iterator=resumed).restore(path)
    assert [b.values[0].tolist() for b in resumed] == rest


@pytest.mark.mpi(min_size=1)
def test_a_per_rank_pipeline_iterator_saves_and_resumes(strategy, world, shared_dir):
    """distribute_datasets_from_function: each rank's pipeline is its own (its shard), so
    its fingerprint would differ between ranks and refuse the save; it carries none."""
    def make():
        return strategy.distribute_datasets_from_function(
            lambda ctx: Dataset.range(40).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .batch(3))

    iterator = iter(make())
    for _ in range(2):
        next(iterator)
    path = ms.Checkpoint(iterator=iterator).save(os.path.join(shared_dir, "fn"))
    rest = [_local(b) for b in iterator]
    resumed = iter(make())
    ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    again = [_local(b) for b in resumed]
    assert len(again) == len(rest)
    for a, b in zip(again, rest):
        np.testing.assert_array_equal(a, b)
