"""Distributed datasets as jobs under mpirun: a position saved at one width resumes the exact
sequence at others (DATA), or is refused naming the policy (FILE) or the cached row that the
ranks computed differently (a random map below cache()); a rank that sees another
copy of a file (its own mount namespace) makes every rank raise; a stopped rank ends the others'
wait in the collective timeout."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import MPIRUN, PRELUDE

JOB = """
import hashlib, os, sys, numpy as np, mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
directory, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
strategy = ms.MultiWorkerMirroredStrategy()
paths = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".bin"))
reader = ms.data.FixedLengthRecordDataset(paths, 16, dtype=np.int32, shape=(4,))
if mode.startswith("file"):
    dataset = reader.batch(10)          # AUTO picks FILE: as many files as ranks
else:
    dataset = reader.global_shuffle().map(lambda r: (r[:, 0], r[:, 1:] * 0.5),
                                          vectorized=True).batch(9)
distributed = strategy.experimental_distribute_dataset(dataset)

def show(epoch, step, batch):
    first = batch[0] if isinstance(batch, tuple) else batch
    parts = world.comm.allgather(np.asarray(first.values[0]))
    if world.rank == 0:
        say("step", epoch, step, hashlib.sha256(np.concatenate(parts).tobytes()).hexdigest()[:16])

checkpoint_dir = os.path.join(directory, "ckpt")
if mode in ("save", "file-save"):
    for batch in distributed:           # epoch 0
        pass
    iterator = iter(distributed)        # epoch 1: a few steps, then the position is saved
    for step in range(steps):
        next(iterator)
    ms.Checkpoint(iterator=iterator).save(checkpoint_dir + "/pos")
    start, epoch = steps, 1
else:
    iterator = iter(distributed)
    try:
        ms.Checkpoint(iterator=iterator).restore(ms.latest_checkpoint(checkpoint_dir))
    except ValueError as err:
        say("error", type(err).__name__, str(err).replace(chr(10), " "))
        sys.exit(0)
    start, epoch = steps, 1
for step, batch in enumerate(iterator, start):   # the rest of epoch 1, then epoch 2
    show(epoch, step, batch)
for step, batch in enumerate(distributed):
    show(2, step, batch)
say("done", world.rank)
"""


def _records(directory, files=4, per_file=50):
    directory.mkdir(exist_ok=True)
    for k in range(files):
        first = np.arange(k * per_file, (k + 1) * per_file, dtype=np.int32)
        np.stack([first, first + 1, first + 2, first + 3], axis=1).tofile(
            directory / f"part-{k}.bin")
    return directory


def _steps(output):
    return re.findall(r"^step (\d+) (\d+) ([0-9a-f]+)$", output, re.M)


def test_a_position_saved_at_4_ranks_resumes_exactly_at_2_and_3(launch, tmp_path):
    data = _records(tmp_path / "data")
    saved = launch(4, JOB, str(data), "save", "7", limit=120)
    assert saved.returncode == 0 and saved.output.count("done") == 4, saved
    uninterrupted = _steps(saved.output)
    assert len(uninterrupted) == (23 - 7) + 23, saved       # 200 rows in batches of 9
    for ranks in (2, 3):
        resumed = launch(ranks, JOB, str(data), "resume", "7", limit=120)
        assert resumed.returncode == 0 and resumed.output.count("done") == ranks, resumed
        assert _steps(resumed.output) == uninterrupted, (ranks, resumed)


def test_a_file_sharded_position_is_refused_at_another_width(launch, tmp_path):
    data = _records(tmp_path / "data")
    saved = launch(2, JOB, str(data), "file-save", "3", limit=120)
    assert saved.returncode == 0, saved
    again = launch(2, JOB, str(data), "file-resume", "3", limit=120)  # same width: exact
    assert _steps(again.output) == _steps(saved.output), again
    refused = launch(4, JOB, str(data), "file-resume", "3", limit=120)
    errors = [l for l in refused.output.splitlines() if l.startswith("error ValueError")]
    assert refused.returncode == 0 and len(errors) == 4 and len(set(errors)) == 1, refused
    assert "saved at 2 ranks under AutoShardPolicy.FILE" in errors[0], errors[0]
    assert "AutoShardPolicy.DATA" in errors[0], errors[0]


CACHED = """
import hashlib, sys, numpy as np, mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
directory, mode, kind = sys.argv[1], sys.argv[2], sys.argv[3]
strategy = ms.MultiWorkerMirroredStrategy()
rng = np.random.default_rng()               # no seed: other values in every process
noise = (lambda x: x + rng.random()) if kind == "random" else (lambda x: x + 0.5)
distributed = strategy.experimental_distribute_dataset(
    ms.data.Dataset.range(40).map(noise).cache().shuffle(40, seed=5).batch(8))

def show(epoch, step, batch):
    parts = world.comm.allgather(np.asarray(batch.values[0]))
    if world.rank == 0:
        say("step", epoch, step, hashlib.sha256(np.concatenate(parts).tobytes()).hexdigest()[:16])

if mode == "save":
    for batch in distributed:           # epoch 0 fills each rank's cache with its rows
        pass
    iterator = iter(distributed)        # epoch 1: 3 steps, then the position is saved
    for step in range(3):
        next(iterator)
    ms.Checkpoint(iterator=iterator).save(directory + "/pos")
else:
    iterator = iter(distributed)
    try:
        ms.Checkpoint(iterator=iterator).restore(ms.latest_checkpoint(directory))
    except ValueError as err:
        say("error", type(err).__name__, str(err).replace(chr(10), " "))
        sys.exit(0)
for step, batch in enumerate(iterator, 3):      # the rest of epoch 1, then epoch 2
    show(1, step, batch)
for step, batch in enumerate(distributed):
    show(2, step, batch)
say("done", world.rank)
"""


def test_a_cached_position_at_another_width_resumes_exactly_or_is_refused(launch, tmp_path):
    """Issue 44: the checkpoint carries each rank's cache() rows. At another width a rank
    takes every saved rank's rows: a deterministic map below the cache resumes the exact
    global batches (as before), while a random map (each rank computed its rows anew, so
    ranks hold other values for a row) is refused on every rank, naming the row, rather than
    giving values the saved ranks would not have."""
    fixed, random = tmp_path / "fixed", tmp_path / "random"
    saved = launch(3, CACHED, str(fixed), "save", "fixed", limit=120)
    assert saved.returncode == 0 and saved.output.count("done") == 3, saved
    uninterrupted = _steps(saved.output)
    assert len(uninterrupted) == (5 - 3) + 5, saved                # 40 rows in batches of 8
    resumed = launch(2, CACHED, str(fixed), "resume", "fixed", limit=120)
    assert resumed.returncode == 0 and resumed.output.count("done") == 2, resumed
    assert _steps(resumed.output) == uninterrupted, resumed

    saved = launch(3, CACHED, str(random), "save", "random", limit=120)
    assert saved.returncode == 0 and saved.output.count("done") == 3, saved
    refused = launch(2, CACHED, str(random), "resume", "random", limit=120)
    errors = [l for l in refused.output.splitlines() if l.startswith("error ValueError")]
    assert refused.returncode == 0 and len(errors) == 2 and len(set(errors)) == 1, refused
    assert "cannot resume this dataset iterator at 2 ranks" in errors[0], errors[0]
    assert "saved at 3 ranks" in errors[0] and "hold different values for row" in errors[0]
    assert "done" not in refused.output


OTHER_COPY = """
import sys, numpy as np, mpistrat as ms
path = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
reader = ms.data.FixedLengthRecordDataset([path], 4, dtype=np.int32)
say("rows", reader.num_rows)
try:
    distributed = strategy.experimental_distribute_dataset(reader.global_shuffle(seed=0).batch(16))
    say("rows seen", sum(len(b.values[0]) for b in distributed))
except Exception as err:
    say("error", type(err).__name__, str(err))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount needs root")
def test_a_rank_seeing_an_older_copy_of_a_file_raises_on_every_rank(tmp_path):
    if not shutil.which("unshare"):
        pytest.skip("unshare is missing")
    data = tmp_path / "data"
    data.mkdir()
    np.arange(200, dtype=np.int32).tofile(data / "train.bin")
    job = tmp_path / "other_copy.py"
    job.write_text(PRELUDE + OTHER_COPY)
    # rank 1 runs in its own mount namespace where the directory holds an older, shorter copy
    older = (f"mount -t tmpfs -o size=1m tmpfs {data} && "
             f"{sys.executable} -c 'import numpy as np; "
             f"np.arange(175, dtype=np.int32).tofile(\"{data}/train.bin\")' && "
             f"exec {sys.executable} {job} {data}/train.bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
    done = subprocess.run([str(MPIRUN), "--limit", "60", "-n", "1", sys.executable, str(job),
                           f"{data}/train.bin", ":", "-n", "1", "unshare", "--mount",
                           "--propagation", "private", "sh", "-c", older],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert sorted(re.findall(r"^rows (\d+)$", done.stdout, re.M)) == ["175", "200"], done.stdout
    errors = [l for l in done.stdout.splitlines() if l.startswith("error InvalidArgumentError")]
    assert done.returncode == 0 and len(errors) == 2 and errors[0] == errors[1], done.stdout
    assert "rank 0: " in errors[0] and "rank 1: " in errors[0] and "train.bin" in errors[0]
    assert "800" in errors[0] and "700" in errors[0]          # the two sizes, in bytes
    assert "rows seen" not in done.stdout


STOPPED = """
import os, signal, sys, time, numpy as np, mpistrat as ms
from mpistrat.runtime import get_world
world = get_world()
where = sys.argv[1]
pids = world.comm.allgather(os.getpid())
strategy = ms.MultiWorkerMirroredStrategy()
dataset = ms.data.Dataset.range(1000).global_shuffle().batch(10)
start = time.monotonic()
try:
    if where == "distribute" and world.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)       # stops before agreeing files and seeds
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    next(iterator)
    if where == "step" and world.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)       # stops between two steps
    start = time.monotonic()
    for _ in iterator:
        pass
    say("no error")
except Exception as err:
    say("error", type(err).__name__, round(time.monotonic() - start), str(err)[:160])
os.kill(pids[1], signal.SIGKILL)
"""


@pytest.mark.parametrize("where", ["distribute", "step"])
def test_a_stopped_rank_ends_the_wait_within_the_collective_timeout(launch, where):
    out = launch(2, STOPPED, where, env={"MPISTRAT_COLLECTIVE_TIMEOUT": "4"}, limit=60)
    assert "error DeadlineExceededError" in out.output, out
    seconds = int(out.output.split("error DeadlineExceededError ")[1].split()[0])
    assert 3 <= seconds <= 15, out
