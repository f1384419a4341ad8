"""TensorFlow checkpoints restored at 1-4 ranks, as a user moving off TensorFlow would:
the program rebuilds its objects under the same names and calls Checkpoint.restore on the
TensorFlow prefix. Every value bit for bit as TensorFlow 2.21 reported it; values matched
through the object graph (a Keras kernel by either of its paths); each value read by one
rank; hostile files refused on every rank; convert at every width."""

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.convert import main as convert
from mpistrat.errors import DataLossError
from mpistrat.tfformats import bundle, bundle_writer

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
REPORT = json.loads((DATA / "values.json").read_text())
VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tf")) if world.rank == 0 else None
    return world.comm.bcast(path, root=0)


def want(name, path):
    entry = REPORT[name][path + VALUE]
    if "strings" in entry:
        return np.array([bytes.fromhex(s) for s in entry["strings"]], dtype=object).reshape(
            entry["shape"])
    return entry


def same_bits(value, entry) -> bool:
    value = np.asarray(value)
    if isinstance(entry, np.ndarray):
        return value.shape == entry.shape and list(value.reshape(-1)) == list(entry.reshape(-1))
    return list(value.shape) == entry["shape"] and value.tobytes().hex() == entry["hex"]


class Dense:
    def __init__(self):
        self.kernel = ms.Variable(np.zeros((3, 4), np.float32))
        self.bias = ms.Variable(np.zeros(4, np.float32))


class Net:
    """The fixture's tf.Module tree (tests/data/make_tf_fixtures.py), rebuilt in mpistrat."""

    def __init__(self):
        self.dense = Dense()
        self.half = np.zeros((2, 3), np.float16)
        self.brain = np.zeros(5, ml_dtypes.bfloat16)
        self.flags = np.zeros(3, bool)
        self.step = ms.Variable(np.int64(0))
        self.ids = np.zeros((2, 2), np.int32)
        self.small = np.zeros(3, np.int8)
        self.pixels = np.zeros(3, np.uint8)
        self.wide = np.zeros((2, 2))
        self.phase = np.zeros(2, np.complex64)
        self.words = np.array([b""] * 3, dtype=object)
        self.empty = np.zeros((0, 3), np.float32)
        self.layers = [Dense(), Dense()]


def module_paths(net):
    return {"model/dense/kernel": net.dense.kernel.numpy(), "model/dense/bias": net.dense.bias.numpy(),
            "model/half": net.half, "model/brain": net.brain, "model/flags": net.flags,
            "model/step": net.step.numpy(), "model/ids": net.ids, "model/small": net.small,
            "model/pixels": net.pixels, "model/wide": net.wide, "model/phase": net.phase,
            "model/words": net.words, "model/empty": net.empty,
            **{f"model/layers/{i}/{n}": getattr(layer, n).numpy()
               for i, layer in enumerate(net.layers) for n in ("kernel", "bias")}}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["module/ckpt-2", "module_sharded/ckpt", "written/weights"])
def test_a_tf_module_tree_restores_bit_for_bit(name):
    net = Net()
    checkpoint = ms.Checkpoint(model=net)
    if name == "written/weights":
        checkpoint.extra = ms.Variable(np.zeros(2, np.float32))
    status = checkpoint.restore(str(DATA / name))
    for path, value in module_paths(net).items():
        if path + VALUE in REPORT[name]:  # TensorFlow's sharded write leaves out the empty one
            assert same_bits(value, want(name, path)), path
    if name == "module_sharded/ckpt":
        assert status.missing_objects == {"model/empty"} and not status.unmatched_values
        with pytest.raises(AssertionError, match="model/empty"):
            status.assert_consumed()
    else:
        status.assert_consumed()
    status.assert_nontrivial_match()
    if name == "module/ckpt-2":
        assert int(checkpoint.save_counter.numpy()) == 2
    elif name == "written/weights":
        assert same_bits(checkpoint.extra.numpy(), want(name, "extra"))


@pytest.mark.mpi(min_size=1)
def test_latest_checkpoint_of_a_tensorflow_directory():
    latest = ms.train.latest_checkpoint(str(DATA / "module"))
    assert latest == str(DATA / "module" / "ckpt-2")
    net = Net()
    ms.Checkpoint(model=net).restore(latest).assert_consumed()
    assert int(net.step.numpy()) == -(2 ** 40) - 2


@pytest.mark.mpi(min_size=1)
def test_statuses_of_a_partial_restore():
    class Part:
        pass
    part = Part()
    part.dense = Dense()
    part.unknown = ms.Variable(np.zeros(1, np.float32))
    status = ms.Checkpoint(model=part).restore(str(DATA / "module/ckpt-1"))
    assert "model/dense/kernel" in status.matched
    assert "model/unknown" in status.missing_objects
    assert "model/half" in status.unmatched_values
    with pytest.raises(AssertionError, match="model/half"):
        status.assert_consumed()
    with pytest.raises(AssertionError, match="model/unknown"):
        status.assert_existing_objects_matched()
    status.expect_partial().assert_nontrivial_match()
    assert same_bits(part.dense.kernel.numpy(), want("module/ckpt-1", "model/dense/kernel"))


@pytest.mark.mpi(min_size=1)
def test_objects_attached_later_get_their_values():
    checkpoint = ms.Checkpoint()
    status = checkpoint.restore(str(DATA / "module/ckpt-1"))
    assert status.matched == {"save_counter"}
    net = Net()
    checkpoint.model = net        # this rank alone reads what the new objects need
    for path, value in module_paths(net).items():
        assert same_bits(value, want("module/ckpt-1", path)), path
    status.assert_consumed()


@pytest.mark.mpi(min_size=1)
def test_a_keras_model_and_adam_restore_through_the_graph():
    name = "keras/ckpt-1"

    def dense(rows, cols):
        return {"_kernel": np.zeros((rows, cols), np.float32), "bias": np.zeros(cols, np.float32)}
    model = {"_functional": {"_operations": [None, dense(4, 3), dense(3, 2)]}}  # other paths
    optimizer = {"_iterations": np.int64(0), "_learning_rate": np.float32(0),
                 "_variables": [None, None] + [np.zeros(s, np.float32) for s in
                                                [(4, 3), (4, 3), 3, 3, (3, 2), (3, 2), 2, 2]]}
    checkpoint = ms.Checkpoint(model=model, optimizer=optimizer)
    status = checkpoint.restore(str(DATA / name))
    kernels = [model["_functional"]["_operations"][i]["_kernel"] for i in (1, 2)]
    assert same_bits(kernels[0], want(name, "optimizer/_trainable_variables/0"))
    assert same_bits(kernels[1], want(name, "optimizer/_trainable_variables/2"))
    for index in range(2, 10):
        assert same_bits(optimizer["_variables"][index], want(name, f"optimizer/_variables/{index}"))
    assert int(optimizer["_iterations"]) == 1
    status.assert_consumed()  # the kernels' canonical paths were consumed through the graph


@pytest.mark.mpi(min_size=1)
def test_legacy_slot_variables():
    checkpoint = ms.Checkpoint(model={"w": np.zeros(3, np.float32)},
                               slots={"m": np.zeros(3, np.float32)})
    status = checkpoint.restore(str(DATA / "slots/ckpt"))
    assert "model/w" in status.matched and "slots/m" in status.missing_objects
    assert status.unmatched_values == {"model/w/.OPTIMIZER_SLOT/optimizer/m",
                                       "model/w/.OPTIMIZER_SLOT/optimizer/v",
                                       "optimizer/beta1_power", "optimizer/beta2_power"}
    assert same_bits(checkpoint.model["w"], want("slots/ckpt", "model/w"))


@pytest.mark.mpi(min_size=1)
def test_each_value_is_read_by_one_rank(world, shared_dir):
    prefix = os.path.join(shared_dir, "big", "ckpt-1")
    values = {f"w{i}": np.full((64, 1024 + 256 * (i % 3)), i, np.float32) for i in range(12)}
    if world.rank == 0:
        os.makedirs(os.path.dirname(prefix))
        items = [(f"{k}{VALUE}", v) for k, v in sorted(values.items())]
        shard = bundle_writer.write_shard(bundle.data_name(prefix, 0, 1), items)
        bundle_writer.write_index(prefix, 1, shard)
    world.comm.Barrier()
    ours = {k: np.zeros_like(v) for k, v in values.items()}
    before = _bytes_read()
    ms.Checkpoint(**ours).restore(prefix)
    read = _bytes_read() - before
    for key, value in values.items():
        assert np.array_equal(ours[key], value), key
    total = sum(v.nbytes for v in values.values())
    largest = max(v.nbytes for v in values.values())
    assert read <= total / world.size + largest + (256 << 10), (read, total)
    assert world.comm.allreduce(read) >= total


def _bytes_read() -> int:
    """Value bytes this rank read from the bundle files (not /proc's rchar, which counts the
    broadcasts' socket reads too across hosts)."""
    from mpistrat.checkpoint.tf_checkpoints import read_counts
    return read_counts["bytes"]


def _corrupt(world, shared_dir, how):
    directory = os.path.join(shared_dir, how)
    prefix = os.path.join(directory, "ckpt-1")
    if world.rank == 0:
        shutil.copytree(DATA / "module", directory)
        entry = bundle.read_index(prefix).entries["model/dense/kernel" + VALUE]
        if how == "data_crc":
            with open(entry.file, "r+b") as handle:
                handle.seek(entry.offset + 5)
                byte = handle.read(1)
                handle.seek(entry.offset + 5)
                handle.write(bytes([byte[0] ^ 0x40]))
        elif how == "truncated_index":
            os.truncate(prefix + ".index", os.path.getsize(prefix + ".index") - 20)
        elif how == "truncated_shard":
            os.truncate(entry.file, entry.offset + 4)
    world.comm.Barrier()
    return prefix


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how, text", [("data_crc", "CRC-32C mismatch"),
                                       ("truncated_index", "ckpt-1.index"),
                                       ("truncated_shard", "beyond the end")])
def test_hostile_checkpoints_are_refused_on_every_rank(world, shared_dir, how, text):
    prefix = _corrupt(world, shared_dir, how)
    net = Net()
    with pytest.raises(DataLossError, match=text):
        ms.Checkpoint(model=net).restore(prefix)
    flags = world.comm.allgather(True)   # every rank got here: nobody hangs
    assert all(flags)


@pytest.mark.mpi(min_size=1)
def test_convert_round_trip_at_every_width(world, shared_dir):
    ours = os.path.join(shared_dir, "ours", "ckpt-1")
    back = os.path.join(shared_dir, "back", "ckpt-1")
    for src, dst in [(str(DATA / "keras/ckpt-1"), ours), (ours, back)]:
        assert convert([src, dst]) == 0
    assert os.path.exists(ours + ".h5")
    assert len([n for n in os.listdir(os.path.dirname(back)) if ".data-" in n]) == world.size
    reader = ms.train.load_checkpoint(back)
    for key, entry in REPORT["keras/ckpt-1"].items():
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            assert same_bits(reader.get_tensor(key), entry), key
    status = ms.Checkpoint(optimizer={"_iterations": np.int64(0)}).restore(ours)
    assert "optimizer/_iterations" in status.matched
    assert convert([ours, back]) == 1  # exists: refused on every rank


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("given", ["index", "directory"])
def test_restore_takes_an_index_path_or_a_directory_as_the_readers_do(given):
    """Before, Checkpoint.restore refused both while load_checkpoint took them."""
    path = str(DATA / "module/ckpt-2.index") if given == "index" else str(DATA / "module")
    net = Net()
    ms.Checkpoint(model=net).restore(path).assert_consumed()
    assert int(net.step.numpy()) == -(2 ** 40) - 2   # ckpt-2's value, the directory's latest


@pytest.mark.mpi(min_size=1)
def test_restore_of_ours_from_its_directory(world, shared_dir):
    saved = {"w": np.arange(5.0)}
    checkpoint = ms.Checkpoint(model=saved)
    checkpoint.save(os.path.join(shared_dir, "ckpt"))
    saved["w"] += 1
    last = checkpoint.save(os.path.join(shared_dir, "ckpt"))
    back = {"w": np.zeros(5)}
    status = ms.Checkpoint(model=back).restore(shared_dir)
    assert status is not None and back["w"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0], last
    empty = os.path.join(shared_dir, "empty")
    if world.rank == 0:
        os.makedirs(empty)
    world.comm.Barrier()
    with pytest.raises(ms.errors.NotFoundError, match="no checkpoint in directory"):
        ms.Checkpoint(model=back).restore(empty)


@pytest.mark.mpi(min_size=1)
def test_a_keras_model_and_its_optimizer_restore_from_tensorflow_through_the_public_path():
    """TensorFlow writes Adam's iterations as int64, Keras 3 on JAX keeps int32: before, every
    model-plus-optimizer restore of a real Keras checkpoint failed ('holds int64[], the object
    is int32[]'). An integer that fits restores into another width."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    keras.backend.clear_session()   # the fixture program's automatic names
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    status = ms.Checkpoint(model=model, optimizer=optimizer).restore(str(DATA / "keras/ckpt-1"))
    status.assert_existing_objects_matched()
    assert optimizer.iterations.dtype == "int32" and int(optimizer.iterations.numpy()) == 1
    expected = {**REPORT["keras/weights"], **REPORT["keras/optimizer"]}
    for variable in list(model.weights) + list(optimizer.variables):
        if variable.path == "adam/iteration":
            continue
        value = np.asarray(variable.numpy())
        assert value.tobytes().hex() == expected[variable.path]["hex"], variable.path


@pytest.mark.mpi(min_size=1)
def test_a_keras_checkpoint_converted_at_this_width_restores_into_the_keras_3_model(shared_dir):
    """convert keeps TensorFlow's names of the variables: the converted file restores the
    Keras 3 model and Adam bit for bit as TensorFlow reported them (before: nothing matched)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    ours = os.path.join(shared_dir, "converted", "ckpt-1")
    assert convert([str(DATA / "keras/ckpt-1"), ours]) == 0
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    ms.Checkpoint(model=model, optimizer=optimizer).restore(ours) \
        .assert_existing_objects_matched()
    expected = {**REPORT["keras/weights"], **REPORT["keras/optimizer"]}
    assert int(optimizer.iterations.numpy()) == 1
    for variable in list(model.weights) + list(optimizer.variables):
        if variable.path != "adam/iteration":
            assert np.asarray(variable.numpy()).tobytes().hex() == \
                expected[variable.path]["hex"], variable.path


@pytest.mark.mpi(min_size=1)
def test_convert_takes_bfloat16_as_our_checkpoints_hold_it(world, shared_dir, capsys):
    """Before, convert refused bfloat16 ('our checkpoints cannot hold model/brain (dtype
    bfloat16)') though ms.Checkpoint saves it: the writer's rule now decides. Strings are
    still refused, named; the bfloat16 value goes there and back bit for bit."""
    ours = os.path.join(shared_dir, "bf16", "ckpt")
    back = os.path.join(shared_dir, "bf16", "back")
    assert convert([str(DATA / "module/ckpt-2"), ours]) == 1
    if world.rank == 0:
        assert "model/words/.ATTRIBUTES/VARIABLE_VALUE (strings)" in capsys.readouterr().err
    assert convert([str(DATA / "module/ckpt-2"), ours, "--skip-unsupported"]) == 0
    assert convert([ours, back]) == 0
    key = "model/brain/.ATTRIBUTES/VARIABLE_VALUE"
    value = ms.train.load_checkpoint(back).get_tensor(key)
    assert value.dtype.name == "bfloat16" and same_bits(value, REPORT["module/ckpt-2"][key])


@pytest.mark.mpi(min_size=1)
def test_integers_restore_into_another_width_only_when_every_value_fits(shared_dir):
    path = ms.Checkpoint(small=np.array([5, -3], np.int64), big=np.array([2 ** 40], np.int64),
                         seed=np.array([7, 2 ** 32 - 1], np.int64),
                         f=np.float64(1.5)).write(os.path.join(shared_dir, "ints"))
    target = {"small": np.zeros(2, np.int32), "seed": np.zeros(2, np.uint32)}
    ms.Checkpoint(**target).read(path).expect_partial()
    assert target["small"].dtype == np.int32 and target["small"].tolist() == [5, -3]
    assert target["seed"].dtype == np.uint32 and target["seed"].tolist() == [7, 2 ** 32 - 1]
    with pytest.raises(ValueError, match=r"'big'.*values from 1099511627776 to 1099511627776, "
                                         r"which do not fit the object's int32"):
        ms.Checkpoint(big=np.zeros(1, np.int32)).read(path)
    with pytest.raises(ValueError, match=r"'small'.*holds int64\[2\], the object is float64"):
        ms.Checkpoint(small=np.zeros(2, np.float64)).read(path)   # floats never change kind


# -- TensorFlow's "Training checkpoints" guide: its checkpoint holds a tf.data iterator -------
GUIDE = "guide/ckpt-4"
ITERATOR = "iterator/.ATTRIBUTES/ITERATOR_STATE"


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_holding_an_iterator_is_listed_and_read_but_the_iterator():
    """Before, listing it failed: 'TensorFlow dtype variant is not supported'."""
    listed = dict(ms.train.list_variables(str(DATA / "guide")))
    assert listed[ITERATOR] == REPORT[GUIDE][ITERATOR]["shape"] == [5]
    reader = ms.train.load_checkpoint(str(DATA / GUIDE))
    assert reader.get_variable_to_dtype_map()[ITERATOR] == "variant"
    with pytest.raises(ms.errors.InvalidArgumentError, match=f"{ITERATOR}.*variant"):
        reader.get_tensor(ITERATOR)
    for key, entry in REPORT[GUIDE].items():
        if entry["dtype"] not in ("variant", "string"):
            assert same_bits(reader.get_tensor(key), want(GUIDE, key[:-len(VALUE)])
                             if key.endswith(VALUE) else entry), key


@pytest.mark.mpi(min_size=1)
def test_a_partial_restore_of_the_guides_checkpoint_skips_the_iterator(world):
    step = ms.Variable(np.int32(0))
    net = {"l1": {"_kernel": np.zeros((4, 5), np.float32), "bias": np.zeros(5, np.float32)}}
    status = ms.Checkpoint(step=step, net=net).restore(str(DATA / GUIDE))
    status.expect_partial().assert_existing_objects_matched()
    assert "iterator/ITERATOR_STATE" in status.unmatched_values   # listed, not read
    assert int(step.numpy()) == 5
    assert same_bits(net["l1"]["_kernel"], want(GUIDE, "net/l1/_kernel"))
    assert same_bits(net["l1"]["bias"], want(GUIDE, "net/l1/bias"))
    with pytest.raises(AssertionError, match="iterator"):
        status.assert_consumed()
    holder = {"ITERATOR_STATE": np.zeros(5, np.int64)}   # an object where the state lies
    with pytest.raises(ValueError, match="TensorFlow variant value there"):
        ms.Checkpoint(iterator=holder).restore(str(DATA / GUIDE))


@pytest.mark.mpi(min_size=1)
def test_convert_names_every_value_it_cannot_hold(world, shared_dir):
    """Before, convert failed on the iterator like the reader (and dropped values it did not
    name elsewhere); now the refusal names it, and --skip-unsupported names it again."""
    out = os.path.join(shared_dir, "guide-ours", "ckpt-4")
    assert convert([str(DATA / GUIDE), out]) == 1
    assert not os.path.exists(out + ".h5")
    assert convert([str(DATA / GUIDE), out, "--skip-unsupported"]) == 0
    back = ms.Checkpoint(step=ms.Variable(np.int32(0)))
    back.restore(out).expect_partial()
    assert int(back.step.numpy()) == 5


@pytest.mark.mpi(min_size=1)
def test_partitioned_variables_restore_bit_for_bit_at_any_width():
    """TF2's MaxShardSizePolicy cut these variables into slices across data shards; each rank
    reads some slices with MPI-IO and every rank ends with the whole tensors."""
    name = "sliced/policy/ckpt"

    class Big:
        pass
    big = Big()
    for attribute in ("emb", "ids", "brain", "small"):
        entry = REPORT[name][f"model/{attribute}" + VALUE]
        dtype = {"bfloat16": ml_dtypes_bfloat16()}.get(entry["dtype"], entry["dtype"])
        setattr(big, attribute, ms.Variable(np.zeros(entry["shape"], dtype)))
    ms.Checkpoint(model=big).restore(str(DATA / name)).assert_existing_objects_matched()
    for attribute in ("emb", "ids", "brain", "small"):
        assert same_bits(getattr(big, attribute).numpy(), want(name, f"model/{attribute}"))


def ml_dtypes_bfloat16():
    import ml_dtypes
    return ml_dtypes.bfloat16
