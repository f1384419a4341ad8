"""Write the TensorFlow fixtures under tests/data/tf/ with real TensorFlow (2.21).

Needs TensorFlow, which the tests do not: run it from a separate environment,

    python3 -m venv /work/tfvenv && /work/tfvenv/bin/pip install tensorflow-cpu==2.21.0
    /work/tfvenv/bin/python tests/data/make_tf_fixtures.py [NAME ...]   # NAME: one fixture

It writes, each beside a JSON of what TensorFlow itself reported when reading the files back
(so the tests compare bit for bit without TensorFlow):

* ``module/``: a ``tf.Module`` tree saved with ``Checkpoint.save`` (state file included):
  float32, float64, float16, bfloat16, bool, int8, uint8, int32, int64, complex64, a string
  tensor and an empty one; ``module_sharded/`` the same values in several data shards.
* ``keras/``: a Keras 3 model and its Adam optimizer after one training step.
* ``written/``: ``Checkpoint.write`` (no state file, no save counter suffix).
* ``slots/``: a legacy ``tf.compat.v1`` Adam optimizer, whose slots are slot variables.
* ``records/``: TFRecord files of ``tf.train.Example`` (plain, GZIP and ZLIB) with float,
  int64 and bytes features, fixed and variable length.
* ``guide/``: the steps of TensorFlow's "Training checkpoints" guide (step, optimizer,
  network and a tf.data iterator, whose state is a ``variant`` tensor), by a CheckpointManager.
* ``sliced/``: partitioned variables: ``policy/`` (TF2's ``MaxShardSizePolicy`` cutting
  float32, int64 and bfloat16 variables into slices across shards) and ``tf1/`` (a TF1
  ``fixed_size_partitioner`` variable along each axis, saved by ``Saver``).
* ``keras_square/``: a Keras model of two same-shaped Dense layers with automatic names.
* ``mixed/``: an Embedding + LSTM + GRU model under ``mixed_float16`` (a LossScaleOptimizer),
  one step of ``model.fit``, saved by a CheckpointManager.
* ``sequence/``: a TFRecord file of ``tf.train.SequenceExample`` (context and feature lists of
  every kind, empty and missing lists, ragged lengths) and of ``tf.train.Example`` with
  variable-length lists; the JSON holds what ``parse_single_sequence_example`` and
  ``parse_sequence_example`` (and ``parse_example`` with ``FixedLenSequenceFeature``) gave for
  several feature specs, or the error they raised.
* ``export_cnn/``, ``mixed_dense/``, ``big_step/`` and TensorFlow's restores into rebuilt
  Keras models (``keras_square/shifted``, ``guide/restored``): see make_tf_keras_fixtures.py.
* ``values.json``: per checkpoint, every tensor key with dtype, shape and the bytes TensorFlow
  returned (hex; strings as hex each); per record file, every record's bytes and the values
  ``tf.io.parse_single_example`` gave.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import make_tf_keras_fixtures  # noqa: E402  (beside this file)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf")


def _tensor_json(value: np.ndarray) -> dict:
    value = np.asarray(value)
    if value.dtype.kind == "O" or value.dtype.kind == "S":
        flat = [bytes(v).hex() for v in value.reshape(-1)]
        return {"shape": list(value.shape), "strings": flat}
    return {"shape": list(value.shape), "hex": np.ascontiguousarray(value).tobytes().hex()}


def _report_checkpoint(prefix: str) -> dict:
    """What tf.train.load_checkpoint reports for every key of ``prefix``."""
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    report = {}
    for key in sorted(dtypes):
        value = reader.get_tensor(key)
        entry = _tensor_json(value)
        entry["dtype"] = dtypes[key].name
        assert entry["shape"] == list(shapes[key]), key
        report[key] = entry
    return report


class Dense(tf.Module):
    def __init__(self):
        super().__init__(name="dense")
        self.kernel = tf.Variable(np.arange(12, dtype=np.float32).reshape(3, 4) / 7)
        self.bias = tf.Variable(np.array([0.5, -1.25, 3.0, 1e-30], np.float32))


class Net(tf.Module):
    def __init__(self):
        super().__init__(name="net")
        rng = np.random.default_rng(18)
        self.dense = Dense()
        self.half = tf.Variable(rng.standard_normal((2, 3)).astype(np.float16))
        self.brain = tf.Variable(tf.constant(rng.standard_normal(5), dtype=tf.bfloat16))
        self.flags = tf.Variable([True, False, True])
        self.step = tf.Variable(np.int64(-(2 ** 40) - 3))
        self.ids = tf.Variable(np.array([[1, -2], [2 ** 31 - 1, -(2 ** 31)]], np.int32))
        self.small = tf.Variable(np.array([-128, 0, 127], np.int8))
        self.pixels = tf.Variable(np.array([0, 17, 255], np.uint8))
        self.wide = tf.Variable(rng.standard_normal((2, 2)))
        self.phase = tf.Variable(np.array([1 + 2j, -3.5j], np.complex64))
        self.words = tf.Variable([b"alpha", b"", b"\x00\xffbytes"])
        self.empty = tf.Variable(np.zeros((0, 3), np.float32))
        self.layers = [Dense(), Dense()]
        self.layers[1].kernel.assign(self.layers[1].kernel * -2)


def module_checkpoints(report: dict) -> None:
    net = Net()
    ckpt = tf.train.Checkpoint(model=net)
    first = ckpt.save(os.path.join(OUT, "module", "ckpt"))
    net.step.assign_add(1)
    net.dense.bias.assign(net.dense.bias * 2)
    second = ckpt.save(os.path.join(OUT, "module", "ckpt"))
    report["module/" + os.path.basename(first)] = _report_checkpoint(first)
    report["module/" + os.path.basename(second)] = _report_checkpoint(second)
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=256)
    options = tf.train.CheckpointOptions(experimental_sharding_callback=policy)
    sharded = ckpt.write(os.path.join(OUT, "module_sharded", "ckpt"), options=options)
    report["module_sharded/" + os.path.basename(sharded)] = _report_checkpoint(sharded)
    written = tf.train.Checkpoint(model=net, extra=tf.Variable([1.5, 2.5]))
    path = written.write(os.path.join(OUT, "written", "weights"))
    report["written/" + os.path.basename(path)] = _report_checkpoint(path)


def keras_checkpoint(report: dict) -> None:
    import keras
    keras.utils.set_random_seed(18)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    y = np.ones((4, 2), np.float32)
    model.train_on_batch(x, y)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = ckpt.save(os.path.join(OUT, "keras", "ckpt"))
    report["keras/" + os.path.basename(path)] = _report_checkpoint(path)
    report["keras/weights"] = {f"{w.path}": _tensor_json(w.numpy()) for w in model.weights}
    report["keras/optimizer"] = {f"{v.path}": _tensor_json(v.numpy())
                                 for v in model.optimizer.variables}


def slot_checkpoint(report: dict) -> None:
    """TF's legacy optimizers keep slot variables (``.OPTIMIZER_SLOT`` in their keys)."""
    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.array([1.0, -2.0, 3.0], np.float32))
    model = Model()
    optimizer = tf.compat.v1.train.AdamOptimizer(0.1)
    optimizer.minimize(lambda: tf.reduce_sum(model.w * model.w), var_list=[model.w])
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(
        os.path.join(OUT, "slots", "ckpt"))
    report["slots/" + os.path.basename(path)] = _report_checkpoint(path)


def _example(i: int) -> tf.train.Example:
    rng = np.random.default_rng(i)
    n = i % 4  # 0..3 values in the variable-length features
    feature = {
        "x": tf.train.Feature(float_list=tf.train.FloatList(
            value=rng.standard_normal(3).astype(np.float32))),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i * 1000003 - 2 ** 40])),
        "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f"record-{i}".encode()])),
        "tags": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(i, i + n)))),
        "weights": tf.train.Feature(float_list=tf.train.FloatList(value=[i / 8] * n)),
        "blobs": tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[bytes([i % 256]) * k for k in range(n)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature))


FEATURES = {
    "x": tf.io.FixedLenFeature([3], tf.float32),
    "label": tf.io.FixedLenFeature([], tf.int64),
    "name": tf.io.FixedLenFeature([], tf.string),
    "tags": tf.io.VarLenFeature(tf.int64),
    "weights": tf.io.VarLenFeature(tf.float32),
    "blobs": tf.io.VarLenFeature(tf.string),
}


def _parsed_json(serialized: bytes) -> dict:
    parsed = tf.io.parse_single_example(serialized, FEATURES)
    out = {}
    for name, value in parsed.items():
        if isinstance(value, tf.SparseTensor):
            out[name] = {"values": _tensor_json(value.values.numpy()),
                         "indices": value.indices.numpy().tolist(),
                         "dense_shape": value.dense_shape.numpy().tolist()}
        else:
            out[name] = _tensor_json(value.numpy())
    return out


def record_files(report: dict) -> None:
    directory = os.path.join(OUT, "records")
    os.makedirs(directory)
    plan = [("plain-%d.tfrecord" % k, None, range(k * 10, k * 10 + 7 - k)) for k in range(4)]
    plan += [("gzip-%d.tfrecord.gz" % k, "GZIP", range(100 + k * 9, 105 + k * 9)) for k in range(2)]
    plan += [("zlib-0.tfrecord.z", "ZLIB", range(200, 204))]
    for name, compression, ids in plan:
        path = os.path.join(directory, name)
        options = tf.io.TFRecordOptions(compression_type=compression or "")
        with tf.io.TFRecordWriter(path, options) as writer:
            for i in ids:
                writer.write(_example(i).SerializeToString())
            if compression is None:
                writer.write(b"")            # an empty record, framed like any other
    for name, compression, _ in plan:
        path = os.path.join(directory, name)
        records = [r.numpy() for r in tf.data.TFRecordDataset(path, compression or "")]
        report["records/" + name] = {
            "compression": compression,
            "records": [r.hex() for r in records],
            "parsed": [_parsed_json(r) if r else None for r in records],
        }


def guide_checkpoint(report: dict) -> None:
    """The steps of TensorFlow's "Training checkpoints" guide: a step counter, an optimizer, a
    Keras network and a tf.data iterator in one checkpoint, saved by a CheckpointManager
    while training. The iterator's state is a ``variant`` tensor (TensorFlow's reader lists
    it; its value is no array), reported by dtype and shape only."""
    import keras
    keras.utils.set_random_seed(5)

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.l1 = keras.layers.Dense(5)

        def call(self, x):
            return self.l1(x)

    inputs = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    dataset = tf.data.Dataset.from_tensor_slices(
        {"x": inputs, "y": inputs[:, :1] * 3}).repeat(10).batch(2)
    net, optimizer = Net(), keras.optimizers.Adam(0.1)
    iterator = iter(dataset)
    ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=optimizer, net=net,
                               iterator=iterator)
    manager = tf.train.CheckpointManager(ckpt, os.path.join(OUT, "guide"), max_to_keep=3)
    for _ in range(4):
        example = next(iterator)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.abs(net(example["x"]) - example["y"]))
        variables = net.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        ckpt.step.assign_add(1)
        path = manager.save()
    reader = tf.train.load_checkpoint(path)
    dtypes, shapes = reader.get_variable_to_dtype_map(), reader.get_variable_to_shape_map()
    entries = {}
    for key in sorted(dtypes):
        if dtypes[key] == tf.variant:
            entries[key] = {"dtype": "variant", "shape": list(shapes[key])}
            continue
        entries[key] = dict(_tensor_json(reader.get_tensor(key)), dtype=dtypes[key].name)
    report["guide/" + os.path.basename(path)] = entries


def sliced_checkpoints(report: dict) -> None:
    """Partitioned variables, both ways TensorFlow writes them: TF2's ``MaxShardSizePolicy``
    cutting variables larger than the shard size into slices across data shards, and a TF1
    graph's ``fixed_size_partitioner`` variable saved by ``Saver`` (V2 format). The index holds
    one entry per variable (dtype, full shape, its slice list) and one per slice under
    OrderedCode keys; TensorFlow's reader returns the reassembled tensors."""
    rng = np.random.default_rng(32)

    class Big(tf.Module):
        def __init__(self):
            super().__init__(name="big")
            self.emb = tf.Variable(rng.standard_normal((40, 6)).astype(np.float32))
            self.ids = tf.Variable(np.arange(-60, 60, dtype=np.int64).reshape(8, 15))
            self.brain = tf.Variable(tf.constant(rng.standard_normal((9, 7)), tf.bfloat16))
            self.small = tf.Variable(np.array([1.5, -2.5], np.float32))     # not cut
    big = Big()
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=200)
    options = tf.train.CheckpointOptions(experimental_sharding_callback=policy)
    path = tf.train.Checkpoint(model=big).write(os.path.join(OUT, "sliced", "policy", "ckpt"),
                                                options=options)
    report["sliced/policy/" + os.path.basename(path)] = _report_checkpoint(path)

    graph = tf.Graph()
    with graph.as_default():
        init = tf.compat.v1.random_uniform_initializer(-1.0, 1.0, seed=7)
        tf.compat.v1.get_variable("part/emb", shape=[10, 7], initializer=init,
                                  partitioner=tf.compat.v1.fixed_size_partitioner(3))
        tf.compat.v1.get_variable("part/cols", shape=[4, 9], dtype=tf.float64,
                                  initializer=tf.compat.v1.random_normal_initializer(seed=3),
                                  partitioner=tf.compat.v1.fixed_size_partitioner(2, axis=1))
        tf.compat.v1.get_variable("plain", initializer=np.array([7, 8, 9], np.int32))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            path = saver.save(session, os.path.join(OUT, "sliced", "tf1", "model.ckpt"),
                              write_meta_graph=False)
    report["sliced/tf1/" + os.path.basename(path)] = _report_checkpoint(path)


def keras_square_checkpoint(report: dict) -> None:
    """A Keras model of two Dense layers of the same shape (3 -> 3 -> 3), saved with its
    automatic layer names (dense, dense_1): a model built after one more layer was made gets
    dense_1 and dense_2, and the same-shaped kernels could land on the wrong layer."""
    import keras
    keras.backend.clear_session()
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(3)])
    path = tf.train.Checkpoint(model=model).write(os.path.join(OUT, "keras_square", "ckpt"))
    report["keras_square/" + os.path.basename(path)] = _report_checkpoint(path)
    report["keras_square/weights"] = {f"{w.path}": _tensor_json(w.numpy()) for w in model.weights}


def mixed_checkpoint(report: dict) -> None:
    """An Embedding + LSTM + GRU model trained one step by ``model.fit`` under the
    ``mixed_float16`` policy, so its optimizer is a LossScaleOptimizer (loss scale, step
    counter and the inner optimizer's slots), saved with a CheckpointManager."""
    import keras
    keras.backend.clear_session()
    keras.utils.set_random_seed(11)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((6,), dtype="int32"),
                                  keras.layers.Embedding(20, 4),
                                  keras.layers.LSTM(5, return_sequences=True),
                                  keras.layers.GRU(3),
                                  keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        x = np.arange(24, dtype=np.int32).reshape(4, 6) % 20
        model.fit(x, np.ones((4, 2), np.float32), epochs=1, verbose=0)
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        manager = tf.train.CheckpointManager(ckpt, os.path.join(OUT, "mixed"), max_to_keep=1)
        path = manager.save()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    report["mixed/" + os.path.basename(path)] = _report_checkpoint(path)
    report["mixed/optimizer"] = type(model.optimizer).__name__


def _sequence_example(i: int) -> bytes:
    """A SequenceExample: ``i`` decides which context features and lists it has and their
    lengths (0 to 3 steps; some lists missing, some empty)."""
    rng = np.random.default_rng(1000 + i)
    steps = i % 4
    context = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i - 2 ** 40])),
               "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f"s{i}".encode()]))}
    if i % 3:
        context["w"] = tf.train.Feature(float_list=tf.train.FloatList(value=[i / 4]))
    lists = {
        "tok": [tf.train.Feature(int64_list=tf.train.Int64List(value=[i * 10 + t]))
                for t in range(steps)],
        "emb": [tf.train.Feature(float_list=tf.train.FloatList(
            value=rng.standard_normal(2).astype(np.float32))) for t in range(steps)],
        "words": [tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[b"w" * k for k in range((i + t) % 3)])) for t in range(steps)],
        "ids": [tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(t + i % 2))))
                for t in range(steps)],
    }
    if i % 5 == 4:
        del lists["tok"], lists["emb"]          # missing lists (allow_missing decides)
    feature_lists = tf.train.FeatureLists(feature_list={
        k: tf.train.FeatureList(feature=v) for k, v in lists.items()})
    return tf.train.SequenceExample(context=tf.train.Features(feature=context),
                                    feature_lists=feature_lists).SerializeToString()


def _parsed(value) -> dict:
    if isinstance(value, tf.SparseTensor):
        return {"values": _tensor_json(value.values.numpy()),
                "indices": value.indices.numpy().tolist(),
                "dense_shape": value.dense_shape.numpy().tolist()}
    return _tensor_json(value.numpy())


def _outcome(call) -> dict:
    """Every output of ``call()`` as JSON, or the error TensorFlow raised."""
    try:
        result = call()
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        return {"error": type(err).__name__, "message": str(err)[-300:]}
    parts = result if isinstance(result, tuple) else (result,)
    return {"parts": [{k: _parsed(v) for k, v in part.items()} for part in parts]}


def sequence_files(report: dict) -> None:
    directory = os.path.join(OUT, "sequence")
    os.makedirs(directory)
    sequences = [_sequence_example(i) for i in range(12)]
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "t": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(2 * (i % 3))))),
        "f": tf.train.Feature(float_list=tf.train.FloatList(value=[i / 3] * (i % 2)))}))
        .SerializeToString() for i in range(5)] + [tf.train.Example().SerializeToString()]
    for name, records in (("sequences.tfrecord", sequences), ("examples.tfrecord", examples)):
        with tf.io.TFRecordWriter(os.path.join(directory, name)) as writer:
            for record in records:
                writer.write(record)
    context = {"id": tf.io.FixedLenFeature([], tf.int64),
               "name": tf.io.FixedLenFeature([], tf.string),
               "w": tf.io.FixedLenFeature([], tf.float32, default_value=-1.0),
               "name_var": tf.io.VarLenFeature(tf.string)}
    specs = {
        "all": (context, {
            "tok": tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True),
            "emb": tf.io.FixedLenSequenceFeature([2], tf.float32, allow_missing=True),
            "words": tf.io.VarLenFeature(tf.string), "ids": tf.io.VarLenFeature(tf.int64)}),
        "required": (None, {"tok": tf.io.FixedLenSequenceFeature([], tf.int64)}),
        "wrong_count": (None, {"emb": tf.io.FixedLenSequenceFeature([3], tf.float32,
                                                                    allow_missing=True)}),
        "wrong_type": (None, {"tok": tf.io.FixedLenSequenceFeature([], tf.float32,
                                                                   allow_missing=True)}),
        "strings_padded": ({"id": tf.io.FixedLenFeature([], tf.int64)}, {
            "words_all": tf.io.VarLenFeature(tf.string)}),
        "context_only": ({"id": tf.io.FixedLenFeature([], tf.int64),
                          "missing": tf.io.VarLenFeature(tf.float32)}, None),
    }
    cases = {}
    for name, (ctx, seq) in specs.items():
        cases[name] = {
            "single": [_outcome(lambda r=r: tf.io.parse_single_sequence_example(r, ctx, seq))
                       for r in sequences],
            "batch": _outcome(lambda: tf.io.parse_sequence_example(sequences, ctx, seq)),
            "batch_first_four": _outcome(
                lambda: tf.io.parse_sequence_example(sequences[:4], ctx, seq))}
    dense = {
        "t": tf.io.FixedLenSequenceFeature([2], tf.int64, allow_missing=True, default_value=-1),
        "f": tf.io.FixedLenSequenceFeature([], tf.float32, allow_missing=True)}
    cases["example_sequence_features"] = {
        "single": [_outcome(lambda r=r: tf.io.parse_single_example(r, dense)) for r in examples],
        "batch": _outcome(lambda: tf.io.parse_example(examples, dense))}
    cases["example_not_a_multiple"] = {"batch": _outcome(lambda: tf.io.parse_example(
        examples, {"t": tf.io.FixedLenSequenceFeature([3], tf.int64, allow_missing=True)}))}
    report["sequence"] = {"sequences": [r.hex() for r in sequences],
                          "examples": [r.hex() for r in examples], "cases": cases}


FIXTURES = {"module": module_checkpoints, "keras": keras_checkpoint, "slots": slot_checkpoint,
            "records": record_files, "guide": guide_checkpoint, "sliced": sliced_checkpoints,
            "keras_square": keras_square_checkpoint, "mixed": mixed_checkpoint,
            "sequence": sequence_files}
FIXTURES.update(make_tf_keras_fixtures.FIXTURES)   # TensorFlow's own restores of Keras files


def main() -> int:
    only = sys.argv[1:]   # fixture names: write (or rewrite) those alone, keep the others
    if not only and os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "values.json")
    report = json.load(open(path)) if only and os.path.exists(path) else {}
    report["tensorflow"] = tf.__version__
    for name in only or FIXTURES:
        shutil.rmtree(os.path.join(OUT, name), ignore_errors=True)
        FIXTURES[name](report)
    with open(os.path.join(OUT, "values.json"), "w") as handle:
        json.dump(report, handle, sort_keys=True, separators=(",", ":"))
        handle.write("\n")
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
