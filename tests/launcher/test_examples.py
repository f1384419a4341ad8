"""The ported examples in jobs/examples/ (issue 16) train at 1 and 2 ranks, and for the same
global batch the losses printed at 1 and 2 ranks agree (float tolerance: the 2-rank gradient is a
sum of two partial sums); the multi-worker tutorial resumes at 3 ranks from a 2-rank checkpoint
with the losses of an uninterrupted run."""

import os
import re
import subprocess
import sys

import pytest

from conftest import MPIRUN, ROOT

EXAMPLES = {
    # example -> (flags, pattern of the loss lines it prints, pattern of its final accuracy)
    "custom_training.py": (["--short", "--global-batch", "32"],
                           r"Epoch \d+, Loss: ([0-9.]+),.*Test Loss: ([0-9.]+)",
                           r"Accuracy after restoring the saved model without strategy: ([0-9.]+)"),
    "keras_jax_custom_loop.py": (["--short", "--global-batch", "32"],
                                 r"Training loss \(for 1 batch\) at step \d+: ([0-9.]+)",
                                 r"Validation acc: ([0-9.]+)"),
}


def _run(example, ranks, tmp_path, flags=None):
    flags = EXAMPLES[example][0] if flags is None else flags
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(PYTHONUNBUFFERED="1", KERAS_BACKEND="jax", PYTHONPATH=str(ROOT))
    env.pop("MPISTRAT_COLLECTIVE_TIMEOUT", None)
    done = subprocess.run([str(MPIRUN), "--limit", "240", "-n", str(ranks), sys.executable,
                           str(ROOT / "jobs" / "examples" / example), *flags],
                          env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def _numbers(output, pattern):
    return [float(x) for match in re.findall(pattern, output)
            for x in (match if isinstance(match, tuple) else (match,))]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_losses_agree_at_one_and_two_ranks(example, tmp_path):
    _, loss_pattern, accuracy_pattern = EXAMPLES[example]
    one = _run(example, 1, tmp_path)
    two = _run(example, 2, tmp_path)
    losses_1, losses_2 = _numbers(one, loss_pattern), _numbers(two, loss_pattern)
    assert len(losses_1) >= 2 and len(losses_1) == len(losses_2), (one, two)
    assert losses_1 == pytest.approx(losses_2, rel=1e-4, abs=1e-5), (losses_1, losses_2)
    assert losses_1[-1] < losses_1[0], f"{example} did not learn: {losses_1}"
    accuracy_1, accuracy_2 = _numbers(one, accuracy_pattern), _numbers(two, accuracy_pattern)
    assert accuracy_1 and accuracy_1 == pytest.approx(accuracy_2, abs=1e-3)
    assert "Number of devices: 2" in two or example != "custom_training.py"


def test_multi_worker_custom_loop_resumes_at_another_width(tmp_path):
    """TensorFlow's multi-worker custom-loop tutorial: 2 epochs at 1 rank give the losses of
    epoch 0 at 2 ranks followed by epoch 1 at 3 ranks, restored from the 2-rank checkpoint."""
    example = "multi_worker_custom_loop.py"
    pattern = r"Epoch: (\d+), accuracy: ([0-9.]+), train_loss: ([0-9.]+)\."

    def epochs(ranks, count, directory):
        output = _run(example, ranks, tmp_path, ["--short", "--global-batch", "30", "--epochs",
                                                 str(count), "--checkpoint-dir", directory])
        return output, re.findall(pattern, output)

    _, whole = epochs(1, 2, str(tmp_path / "one"))
    _, first = epochs(2, 1, str(tmp_path / "resumed"))
    output, second = epochs(3, 2, str(tmp_path / "resumed"))
    assert "epoch 1, step_in_epoch 0" in output, output[-2000:]
    assert [e for e, _, _ in whole] == ["0", "1"] and [e for e, _, _ in first + second] == \
        ["0", "1"], (whole, first, second)
    got = [float(x) for _, accuracy, loss in first + second for x in (accuracy, loss)]
    want = [float(x) for _, accuracy, loss in whole for x in (accuracy, loss)]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (got, want)
    assert want[3] < want[1], f"the loss did not fall: {whole}"


def _horovod(ranks, directory, *flags, mpirun_args=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(PYTHONUNBUFFERED="1", KERAS_BACKEND="jax", PYTHONPATH=str(ROOT))
    done = subprocess.run([str(MPIRUN), "--limit", "240", *mpirun_args, "-n", str(ranks),
                           sys.executable, str(ROOT / "jobs" / "examples" / "horovod_keras_mnist.py"),
                           "--dir", str(directory), *flags], env=env, cwd=directory.parent,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def _digests(output, verb):
    # (no line anchors: the launcher may join two ranks' lines)
    return dict(re.findall(rf"rank (\d+): {verb} \S+?, weights ([0-9a-f]{{16}})", output))


def test_horovod_keras_mnist_trains_at_1_and_2_ranks_and_resumes_at_3(tmp_path):
    """Horovod's Keras MNIST steps under mpistrat.horovod: every rank ends with the same
    weights and learns; the 2-rank checkpoint restores bit for bit at 3 ranks."""
    for ranks in (1, 2):
        out = _horovod(ranks, tmp_path / f"np{ranks}", "--epochs", "3")
        saved = _digests(out, "saved")
        assert sorted(saved) == [str(r) for r in range(ranks)] and len(set(saved.values())) == 1
        assert float(re.search(r"test accuracy ([0-9.]+)", out).group(1)) > 0.8, out[-2000:]
    resumed = _horovod(3, tmp_path / "np2", "--resume", "--epochs", "1")
    restored = _digests(resumed, "restored")
    assert sorted(restored) == ["0", "1", "2"], resumed[-3000:]
    assert set(restored.values()) == set(saved.values()), (restored, saved)
    assert len(set(_digests(resumed, "saved").values())) == 1


def _flow(ranks, directory, epochs):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(PYTHONUNBUFFERED="1", KERAS_BACKEND="jax", PYTHONPATH=str(ROOT))
    done = subprocess.run([str(MPIRUN), "--limit", "120", "-n", str(ranks), sys.executable,
                           str(ROOT / "jobs" / "examples" / "horovod_imagenet_flow.py"),
                           "--dir", str(directory), "--epochs", str(epochs)], env=env,
                          cwd=directory.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def _flow_rate(epoch, ranks, base_lr=0.0125, warmup=2, schedule=(3, 4, 5)):
    """The rate epoch ``epoch``'s last batch ran at: Horovod's warm-up (its last batch at
    fractional epoch ``epoch + 1``), then the steps down by 10."""
    scaled = base_lr * ranks
    if epoch < warmup:
        return scaled / ranks * ((epoch + 1) * (ranks - 1) / warmup + 1)
    return scaled * 10.0 ** -sum(epoch >= e for e in schedule)


def test_horovod_imagenet_flow_resumes_from_rank_0s_checkpoint_at_another_width(tmp_path):
    """Horovod's Keras ImageNet flow: 2 epochs at 2 ranks, then resumed at 3 ranks to epoch 4.
    Every rank resumes at epoch 2 (found on rank 0, broadcast); only rank 0 checkpoints (one
    file per epoch, each written once); the rates follow the warm-up and the schedule at each
    run's width; every rank ends with the same weights."""
    directory = tmp_path / "flow"
    first = _flow(2, directory, 2)
    second = _flow(3, directory, 4)
    assert sorted(re.findall(r"rank (\d+): resuming from epoch 0", first)) == ["0", "1"]
    assert sorted(re.findall(r"rank (\d+): resuming from epoch 2", second)) == \
        ["0", "1", "2"], second[-3000:]
    for output in (first, second):
        assert re.findall(r"rank (\d+): checkpointing to", output) == ["0"], output[-3000:]
    assert sorted(p.name for p in directory.glob("checkpoint-*")) == \
        [f"checkpoint-{e}.keras" for e in (1, 2, 3, 4)]
    for output, ranks, epochs in ((first, 2, (0, 1)), (second, 3, (2, 3))):
        rates = re.findall(r"rank (\d+): epoch (\d+) lr ([0-9.e-]+)", output)
        assert sorted({(int(r), int(e)) for r, e, _ in rates}) == \
            [(r, e) for r in range(ranks) for e in epochs], output[-3000:]
        for _, epoch, rate in rates:
            assert float(rate) == pytest.approx(_flow_rate(int(epoch), ranks), rel=1e-5), \
                (epoch, rate, ranks)
    for output, ranks in ((first, 2), (second, 3)):
        final = dict(re.findall(r"rank (\d+): done at epoch \d+, weights ([0-9a-f]{16})", output))
        assert sorted(final) == [str(r) for r in range(ranks)] and len(set(final.values())) == 1, \
            output[-3000:]
    log = (directory / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in log[1:]] == ["0", "1", "2", "3"], log
