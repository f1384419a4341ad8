"""Distributed datasets at 1-4 ranks: TensorFlow's measured rebatch cases, policies, lockstep."""

import itertools
import warnings

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import AutoShardPolicy, Dataset, Options, cache_state

pytestmark = pytest.mark.numpy_only(
    "datasets yield NumPy batches from the host input pipeline (CuPy batches: "
    "tests/gpu)")

# Measured with TensorFlow 2.21 (DESIGN.md section 2): per step, the batch of each replica.
MEASURED = {
    (10, 5, 2): [[[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]]],
    (14, 5, 4): [[[0, 1], [2, 3], [4], []], [[5, 6], [7, 8], [9], []],
                 [[10], [11], [12], [13]]],
    (14, 8, 4): [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11], [12, 13], []]],
}


def local_batches(strategy, dataset):
    return [batch.values[0].tolist() for batch in strategy.experimental_distribute_dataset(dataset)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(MEASURED))
def test_rebatch_matches_tensorflow(strategy, world, case):
    count, batch, ranks = case
    if world.size != ranks:
        pytest.skip(f"measured at {ranks} ranks")
    steps = MEASURED[case]
    assert local_batches(strategy, Dataset.range(count).batch(batch)) == \
        [step[world.rank] for step in steps]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count,batch", [(10, 5), (14, 5), (7, 3), (2, 4)])
def test_data_policy_covers_every_row_once_with_empty_tails(strategy, world, count, batch):
    mine = local_batches(strategy, Dataset.range(count).batch(batch))
    everyone = world.comm.allgather(mine)
    assert len({len(steps) for steps in everyone}) == 1  # lockstep
    rows = sorted(x for steps in everyone for step in steps for x in step)
    assert rows == list(range(count))


@pytest.mark.mpi(min_size=1)
def test_off_policy_duplicates_and_steps_through_every_slice(strategy, world):
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    mine = local_batches(strategy, Dataset.range(10).batch(5).with_options(options))
    assert sum(mine, []) == list(range(10))  # every rank sees everything
    assert len(mine) == 2 * world.size


@pytest.mark.mpi(min_size=2)
def test_ranks_step_together_until_the_last_one_runs_dry(strategy, world):
    def dataset_fn(ctx):
        assert ctx.num_input_pipelines == world.size and ctx.input_pipeline_id == world.rank
        return Dataset.from_tensor_slices(np.arange(3 + ctx.input_pipeline_id, dtype=np.int16)
                                          .reshape(-1, 1)).batch(1)

    steps = [b.values[0] for b in strategy.distribute_datasets_from_function(dataset_fn)]
    assert len(steps) == 3 + world.size - 1  # the longest rank decides
    assert [int(s[0, 0]) for s in steps[:3 + world.rank]] == list(range(3 + world.rank))
    assert all(s.shape == (0, 1) and s.dtype == np.int16 for s in steps[3 + world.rank:])


@pytest.mark.mpi(min_size=2)
def test_a_rank_without_any_data_learns_the_batch_layout(strategy, world):
    def dataset_fn(ctx):
        rows = 2 if ctx.input_pipeline_id == 0 else 0
        return Dataset.from_tensor_slices({"x": np.ones((rows, 3), np.float32)}).batch(1)

    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert len(batches) == 2
    # a dict batch comes back as a dict of PerReplica values, as in TensorFlow
    assert all(isinstance(b, dict) and isinstance(b["x"], ms.PerReplica) for b in batches)
    steps = [b["x"].values[0] for b in batches]
    if world.rank:
        assert all(s.shape == (0, 3) and s.dtype == np.float32 for s in steps)


@pytest.mark.mpi(min_size=1)
def test_batches_feed_run_and_reduce_with_true_row_counts(strategy, world):
    total = 0.0
    for batch in strategy.experimental_distribute_dataset(Dataset.range(14).batch(5)):
        per_replica = strategy.run(lambda x: x.astype(np.float64) * 2, args=(batch,))
        total += strategy.reduce("SUM", per_replica, axis=0)
        mean = strategy.reduce("MEAN", per_replica, axis=0)
        assert mean == pytest.approx(2 * np.mean(
            np.concatenate(world.comm.allgather(batch.values[0]))))
    assert total == 2 * sum(range(14))


@pytest.mark.mpi(min_size=1)
def test_unbatched_and_file_policy_rejected(strategy):
    with pytest.raises(ValueError, match="batched"):
        strategy.experimental_distribute_dataset(Dataset.range(4))
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    with pytest.raises(ValueError, match="FILE"):
        strategy.experimental_distribute_dataset(Dataset.range(4).batch(2).with_options(options))


@pytest.mark.mpi(min_size=1)
def test_iterator_state_round_trip_through_a_checkpoint(strategy, world, tmp_path_factory):
    directory = world.comm.bcast(str(tmp_path_factory.mktemp("it")) if world.rank == 0 else None)

    def make():
        dataset = Dataset.range(40).shuffle(10, seed=1).repeat(2).batch(6)
        return iter(strategy.experimental_distribute_dataset(dataset))

    first = make()
    seen = [next(first).values[0].tolist() for _ in range(7)]
    path = ms.Checkpoint(iterator=first).save(directory + "/ckpt")
    rest = [b.values[0].tolist() for b in first]
    resumed = make()
    ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    assert [b.values[0].tolist() for b in resumed] == rest
    everyone = world.comm.allgather(seen + rest)
    rows = sorted(x for steps in everyone for batch in steps for x in batch)
    assert rows == sorted(list(range(40)) * 2)  # nothing repeated, nothing skipped


@pytest.mark.mpi(min_size=1)
def test_cache_under_a_distributed_dataset_keeps_each_ranks_rows_and_resumes(
        strategy, world, tmp_path_factory):
    """Each rank computes (and keeps) the rows it is asked for, once; the global batches of each
    epoch are those of the same pipeline without cache (a global shuffle above reshuffles
    them); an iterator saved in epoch 1 and restored in a new process-like pipeline (nothing
    cached yet) continues with the same rows."""
    directory = world.comm.bcast(str(tmp_path_factory.mktemp("cache")) if world.rank == 0
                                 else None)
    calls = []

    def pipeline(cache):
        dataset = Dataset.range(23).map(lambda x: calls.append(int(x)) or x * 3,
                                        vectorized=False)
        dataset = dataset.cache() if cache else dataset
        return strategy.experimental_distribute_dataset(
            dataset.global_shuffle(seed=5).repeat(3).batch(4))

    def rows(batches):
        return [batch.values[0].tolist() for batch in batches]

    iterator = iter(pipeline(cache=True))
    seen = rows(next(iterator) for _ in range(8))             # into the second epoch
    path = ms.Checkpoint(iterator=iterator).save(directory + "/ckpt")
    rest = rows(iterator)
    assert len(calls) == len(set(calls))                      # each row computed once
    assert seen + rest == rows(pipeline(cache=False))         # the same global batches
    resumed = iter(pipeline(cache=True))
    ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    assert rows(resumed) == rest


def _rows_plus_noise(source):
    """Rows 0-29, each plus a fraction drawn from a NumPy generator without a seed (fresh
    entropy in every pipeline, so no two runs agree): a value's integer part is its row."""
    rng = np.random.default_rng()
    rows = Dataset.range(30) if source == "range" else Dataset.from_generator(
        lambda: iter(range(30)), output_signature=ms.data.TensorSpec((), np.int64))
    return rows.map(lambda x: x + rng.random())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("source", ["range", "generator"])
def test_a_resumed_cache_yields_the_values_a_random_map_gave_before_the_save(
        strategy, world, tmp_path_factory, source):
    """Issue 44: a map drawing from an unseeded random generator, cached, then shuffled (with
    a seed) and batched, distributed; the iterator saved in the second epoch and restored
    into a fresh pipeline (nothing cached, another generator) computed the cached rows again,
    so the rest of the run had other values (18 of the 30 of the next epoch). The checkpoint
    now carries what each rank's cache holds, as tf.data's iterator checkpoint carries its
    cache: every value this rank was given before the save comes back bit for bit, in the
    rest of the epoch and in the epochs after. Where every rank holds every row after the
    first epoch (one rank; a generator source, which every rank reads whole), that is all
    the values of the uninterrupted run."""
    directory = world.comm.bcast(str(tmp_path_factory.mktemp("noise")) if world.rank == 0
                                 else None)

    def pipeline():
        return strategy.experimental_distribute_dataset(
            _rows_plus_noise(source).cache().shuffle(30, seed=7).batch(8))

    def steps(batches):
        return [np.asarray(batch.values[0]) for batch in batches]

    first = pipeline()
    before = steps(first)                                    # epoch 0 fills the cache
    iterator = iter(first)                                   # the second epoch: 2 steps
    before += steps(itertools.islice(iterator, 2))
    path = ms.Checkpoint(iterator=iterator).save(directory + "/ckpt")
    rest = steps(iterator) + steps(first) + steps(first)     # its rest, then two epochs more
    fresh = pipeline()                                       # nothing cached, another generator
    resumed = iter(fresh)
    with warnings.catch_warnings():     # (the generator's pipeline replays its 2 steps: warned)
        warnings.simplefilter("ignore")
        ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    again = steps(resumed) + steps(fresh) + steps(fresh)

    def rows(found):
        return [step.astype(np.int64).tolist() for step in found]

    assert len(rest) == 2 + 4 + 4 and rows(again) == rows(rest)   # the same rows, same places
    known = {int(v) for step in before for v in step}        # in this rank's cache at the save
    pairs = [(a, b) for x, y in zip(rest, again) for a, b in zip(x, y) if int(a) in known]
    assert pairs and all(a.tobytes() == b.tobytes() for a, b in pairs)
    if world.size == 1:
        assert known == set(range(30))
    if world.size == 1 or source == "generator":   # (the cache holds every row)
        assert [s.tobytes() for s in again] == [s.tobytes() for s in rest]


@pytest.mark.mpi(min_size=1)
def test_a_cache_larger_than_the_limit_is_refused_by_name_on_every_rank(
        strategy, world, tmp_path_factory, monkeypatch):
    """The cache travels in the checkpoint, so it is bounded: past
    ``cache_state.LIMIT_BYTES`` (all ranks' rows together) the save raises the same
    ``ValueError`` on every rank, naming the limit and each rank's bytes, and writes nothing;
    under it the same iterator saves and resumes."""
    directory = world.comm.bcast(str(tmp_path_factory.mktemp("limit")) if world.rank == 0
                                 else None)

    def make():
        return iter(strategy.experimental_distribute_dataset(
            Dataset.range(40).map(lambda x: x * 0.5).cache().batch(8)))

    iterator = make()
    next(iterator)
    checkpoint = ms.Checkpoint(iterator=iterator)
    monkeypatch.setattr(cache_state, "LIMIT_BYTES", 64)
    with pytest.raises(ValueError, match="LIMIT_BYTES") as caught:
        checkpoint.save(directory + "/ckpt")
    assert len(set(world.comm.allgather(str(caught.value)))) == 1
    assert all(f"rank {r}: " in str(caught.value) for r in range(world.size))
    assert int(checkpoint.save_counter.numpy()) == 0 and ms.latest_checkpoint(directory) is None
    monkeypatch.setattr(cache_state, "LIMIT_BYTES", 1 << 20)
    path = checkpoint.save(directory + "/ckpt")
    rest = [batch.values[0].tolist() for batch in iterator]
    resumed = make()
    ms.Checkpoint(iterator=resumed).restore(path).assert_consumed()
    assert [batch.values[0].tolist() for batch in resumed] == rest


def finite_rule(batch, ranks, rank):
    """DESIGN.md's rebatch rule: slices of ceil(B/N) rows in replica order, the rest empty."""
    per = -(-len(batch) // ranks)
    start = min(rank * per, len(batch))
    return batch[start:min(start + per, len(batch))]


ENDLESS = {   # issue 44: endless pipelines (and one made finite by take) over 10 rows
    "repeat": lambda ds: ds.repeat().batch(4),
    "shuffle-repeat": lambda ds: ds.shuffle(7, seed=3).repeat().batch(4),   # random access
    "repeat-shuffle": lambda ds: ds.repeat().shuffle(7, seed=3).batch(4),   # walked
    "repeat-take": lambda ds: ds.repeat().batch(4).take(10),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", sorted(ENDLESS))
def test_endless_repeat_yields_its_first_steps_at_once_by_the_finite_rule(strategy, world, case):
    """Issue 44: the first steps of an endless ``repeat().batch(4)`` come at once (before, a
    rank planned 64 Mi steps ahead at its second step: minutes and gigabytes), and each rank's
    rows are those the finite rule gives for the same global batches, which a finite dataset
    of those batches yields too (a rank left with 0 rows at 3 ranks included)."""
    def pipeline():
        return ENDLESS[case](Dataset.from_tensor_slices(np.arange(10, dtype=np.int64) * 10))

    steps = 50
    iterator = iter(strategy.experimental_distribute_dataset(pipeline()))
    mine = [batch.values[0].tolist() for batch in itertools.islice(iterator, steps)]
    global_batches = [batch.tolist() for batch in itertools.islice(pipeline(), steps)]
    expected_steps = 10 if case == "repeat-take" else steps
    assert pipeline().cardinality() == (10 if case == "repeat-take"
                                        else ms.data.INFINITE_CARDINALITY)
    assert len(mine) == len(global_batches) == expected_steps
    assert mine == [finite_rule(batch, world.size, world.rank) for batch in global_batches]
    finite = Dataset.from_tensor_slices(np.array(sum(global_batches, []), np.int64)).batch(4)
    assert local_batches(strategy, finite) == mine
    if case == "repeat-take":   # every rank ends on the same step
        assert next(iterator, None) is None


@pytest.mark.mpi(min_size=2)
def test_a_failure_on_one_rank_raises_on_every_rank_at_its_step(strategy, world):
    """Every rank yields each step before the one its input failed on, then raises at that
    step, naming the rank that failed (a generator: the ranks meet at every step)."""
    failing_rank, bad_step = world.size - 1, 37

    def dataset_fn(ctx):
        def rows():
            for step in range(60):
                if ctx.input_pipeline_id == failing_rank and step == bad_step:
                    raise ValueError(f"step {step} is bad")
                yield np.array([step], np.int64)
        spec = ms.data.TensorSpec(shape=(1,), dtype=np.int64)
        return Dataset.from_generator(rows, output_signature=spec)

    got = []
    with pytest.raises(ValueError, match=f"input step {bad_step} failed: rank {failing_rank}"):
        for values in strategy.distribute_datasets_from_function(dataset_fn):
            got.append(int(values.values[0][0]))
    assert got == list(range(bad_step))


@pytest.mark.mpi(min_size=2)
def test_ranks_meet_a_window_of_steps_at_a_time(strategy, world):
    """200 steps of a random-access pipeline take far fewer than 200 collectives (windows
    grow to 16 steps), and every rank yields the same steps as meeting at each step would:
    its rows, then 0-row batches while another rank still has data. A generator's ranks
    meet at every step (it may wait on the loop: nothing is read ahead)."""
    engine = strategy.extended.engine
    rows = 200 * world.size - 1                      # the last global batch is one row short
    dataset = Dataset.from_tensor_slices(np.arange(rows)).batch(world.size)
    distributed = strategy.experimental_distribute_dataset(dataset)
    before = engine._calls                           # (collectives this engine made)
    steps = [values.values[0].tolist() for values in distributed]
    meetings = engine._calls - before
    assert len(steps) == 200
    assert steps[:-1] == [[s * world.size + world.rank] for s in range(199)]
    last = 199 * world.size + world.rank
    assert steps[-1] == ([last] if last < rows else [])
    assert meetings <= 60, meetings                  # (one a step would be 200)

    def rows():                                      # no random access: no reading ahead
        yield from (np.array([k], np.int64) for k in range(40 * world.size))
    spec = ms.data.TensorSpec(shape=(1,), dtype=np.int64)
    generated = Dataset.from_generator(rows, output_signature=spec).batch(world.size)
    before = engine._calls
    assert len(list(strategy.experimental_distribute_dataset(generated))) == 40
    assert engine._calls - before >= 40
