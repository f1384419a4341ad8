"""ms.summary: TensorBoard event files without TensorFlow. Read back by our TFRecord reader
and, where a Python with TensorFlow is at hand (MPISTRAT_TEST_TF_PYTHON), by TensorBoard's own
summary_iterator (or TensorBoard's EventAccumulator where installed): the same tags, steps
and values."""

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.tfformats import messages
from mpistrat.runtime import settings


def events(path):
    return [messages.parse("Event", bytes(r), path) for r in ms.data.TFRecordDataset(str(path))]


def test_scalars_are_events_after_the_file_version(tmp_path):
    writer = ms.summary.create_file_writer(str(tmp_path / "train"))
    values = [0.5, 0.0, -1.25, math.inf]
    for step, value in enumerate(values):
        writer.scalar("epoch_loss", value, step=step)
    writer.close()
    (path,) = (tmp_path / "train").iterdir()
    assert path.name.startswith("events.out.tfevents.")
    read = events(path)
    assert read[0].file_version == "brain.Event:2"
    got = [(e.step, e.summary.value[0].tag, e.summary.value[0].simple_value) for e in read[1:]]
    assert got == [(s, "epoch_loss", v) for s, v in enumerate(values)]   # 0.0 written too
    assert all(e.wall_time > 1.7e9 for e in read)


def test_tensorboard_reads_them(tmp_path):
    python = settings.get("MPISTRAT_TEST_TF_PYTHON")
    if not python or not os.path.exists(python):
        pytest.skip(f"no Python with TensorFlow/TensorBoard at {python!r} "
                    f"(MPISTRAT_TEST_TF_PYTHON)")
    writer = ms.summary.create_file_writer(str(tmp_path))
    for step in range(5):
        writer.scalar("epoch_accuracy", step / 4, step=step)
    writer.close()
    script = ("import glob, json, os, sys\n"
              "os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
              "try:\n"
              "    from tensorboard.backend.event_processing.event_accumulator import "
              "EventAccumulator\n"
              "    acc = EventAccumulator(sys.argv[1]); acc.Reload()\n"
              "    got = [[e.step, e.value] for e in acc.Scalars('epoch_accuracy')]\n"
              "except ImportError:\n"
              "    import tensorflow as tf\n"
              "    (path,) = glob.glob(os.path.join(sys.argv[1], 'events.out.tfevents.*'))\n"
              "    got = [[e.step, v.simple_value] for e in tf.compat.v1.train.summary_iterator("
              "path) for v in e.summary.value if v.tag == 'epoch_accuracy']\n"
              "print(json.dumps(got))\n")
    done = subprocess.run([python, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[s, s / 4] for s in range(5)]
