"""``convert`` in one process: TensorFlow -> ours -> TensorFlow gives back the original keys,
dtypes, shapes, bytes and object graph (TF1 names stay TF1 names); names that are not ASCII
work end to end (convert and ms.Checkpoint); every key left out is named; collisions are
refused before anything is written, naming both keys.

TensorFlow 2.21 itself restored the round-tripped files into the original objects (checked
by hand; tests/launcher/test_tf_convert.py repeats it at 1-3 ranks where TensorFlow is
installed): TF1's Saver into the original graph (partitioned variables too), and
``tf.train.Checkpoint.read`` into the original tf.Module (non-ASCII names) and Keras model.
"""

import os
import unicodedata
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint import tf_origin
from mpistrat.convert import convert, main
from mpistrat.errors import DataLossError, InvalidArgumentError
from mpistrat.tfformats import bundle, bundle_writer, messages, object_graph

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
GRAPH = object_graph.GRAPH_KEY
EXACT = ["keras/ckpt-1", "keras_square/ckpt", "mixed/ckpt-1", "sliced/policy/ckpt",
         "sliced/tf1/model.ckpt", "names/tf1/model.ckpt", "names/unicode/ckpt"]


def _round_trip(tmp_path, source, skip=False):
    ours, back = str(tmp_path / "ours" / "ckpt"), str(tmp_path / "back" / "ckpt")
    first = convert(str(source), ours, skip_unsupported=skip)
    second = convert(ours, back)
    return first, second, ours, back


def _table(prefix):
    reader = ms.train.load_checkpoint(prefix)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    out = {}
    for key in shapes:
        value = np.asarray(reader.get_tensor(key), dtype=None)
        data = value.tobytes() if value.dtype != object else \
            b"|".join(bytes(v) for v in value.reshape(-1))
        out[key] = (str(dtypes[key]), shapes[key], data)
    return out


@pytest.mark.parametrize("name", EXACT)
def test_tensorflow_to_ours_and_back_is_the_original(tmp_path, name):
    first, second, ours, back = _round_trip(tmp_path, DATA / name)
    assert first[3] == [] and first[1] == second[1]
    assert _table(back) == _table(str(DATA / name))      # keys, dtypes, shapes, bytes, graph
    with h5py.File(ours + ".h5") as f:                    # the origin is kept, readable
        keys = {}
        f.visititems(lambda n, o: keys.update({n: o.attrs[tf_origin.TF_KEY_ATTR]})
                     if isinstance(o, h5py.Dataset) else None)
        assert (tf_origin.GRAPH_ATTR in f.attrs) == ("tf1" not in name)
    assert sorted(keys.values()) == sorted(k for k in _table(back) if k != GRAPH)


def test_tf1_names_stay_tf1_names(tmp_path):
    """Before, the round trip renamed part/emb to part/emb/.ATTRIBUTES/VARIABLE_VALUE and
    added a graph, so TF1's Saver could not restore it."""
    *_, back = _round_trip(tmp_path, DATA / "sliced/tf1/model.ckpt")
    assert [k for k, _ in ms.train.list_variables(back)] == ["part/cols", "part/emb", "plain"]


def test_a_value_left_out_is_named_and_its_attribute_leaves_the_graph(tmp_path):
    first, _, _, back = _round_trip(tmp_path, DATA / "module/ckpt-2", skip=True)
    key = "model/words/.ATTRIBUTES/VARIABLE_VALUE"
    assert first[3] == [f"{key} (strings)"]
    original, got = _table(str(DATA / "module/ckpt-2")), _table(back)
    assert set(original) - set(got) == {key}
    assert {k: v for k, v in original.items() if k not in (key, GRAPH)} == \
        {k: v for k, v in got.items() if k != GRAPH}
    graph_of = {p: object_graph.parse_graph(ms.train.load_checkpoint(p).get_tensor(GRAPH), p)
                for p in (str(DATA / "module/ckpt-2"), back)}
    before, after = graph_of.values()
    assert [v for v in before.values if v.key != key] == after.values
    assert before.children == after.children


def test_skip_unsupported_lists_every_key_it_skips(tmp_path, capsys):
    assert main([str(DATA / "guide/ckpt-4"), str(tmp_path / "o" / "ckpt"),
                 "--skip-unsupported"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1: iterator/.ATTRIBUTES/ITERATOR_STATE (TensorFlow dtype variant)" in out
    assert main([str(DATA / "guide/ckpt-4"), str(tmp_path / "p" / "ckpt")]) == 1
    assert "cannot hold iterator/.ATTRIBUTES/ITERATOR_STATE" in capsys.readouterr().err


def test_names_that_are_not_ascii_convert_both_ways(tmp_path):
    first, _, ours, back = _round_trip(tmp_path, DATA / "names/unicode/ckpt")
    assert first[1] == 5
    with h5py.File(ours + ".h5") as f:
        assert f["model/café"].shape == (3,) and f["model/重み"].shape == (2, 3)
        assert f["model/table/ключ"][()].tolist() == [7, 8]
    reader = ms.train.load_checkpoint(back)
    assert reader.get_tensor("model/sub/naïve/.ATTRIBUTES/VARIABLE_VALUE") == 0.125


def test_ms_checkpoint_saves_and_restores_names_that_are_not_ascii(tmp_path):
    class Model:
        pass
    model, other = Model(), Model()
    nfd = unicodedata.normalize("NFD", "café")              # a combining accent: its own name
    for target, scale in ((model, 1), (other, 0)):
        setattr(target, "café", ms.Variable(np.arange(3.0) * scale))
        setattr(target, nfd, np.full(2, 5.0 * scale))
        setattr(target, "重み", {"ключ": np.ones((2, 2), np.float32) * scale})
    path = ms.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    ms.Checkpoint(model=other).restore(path).assert_consumed()
    assert getattr(other, "café").numpy().tolist() == [0.0, 1.0, 2.0]
    assert getattr(other, nfd).tolist() == [5.0, 5.0]
    assert getattr(other, "重み")["ключ"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    back = str(tmp_path / "tf" / "ckpt")
    convert(path, back)                                    # ours -> TensorFlow: UTF-8 keys
    assert ms.train.load_checkpoint(back).get_tensor(
        "model/重み/ключ/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [[1.0, 1.0], [1.0, 1.0]]


def _bundle(prefix, items, graph=None):
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    items = list(items) + ([(GRAPH, np.array(graph, dtype=object))] if graph else [])
    entries = bundle_writer.write_shard(bundle.data_name(prefix, 0, 1),
                                        sorted(items, key=lambda kv: kv[0].encode()))
    bundle_writer.write_index(prefix, 1, entries)


@pytest.mark.parametrize("keys, words", [
    (["a/b", "a/b/c"], "'a/b'"),                                    # a value and a prefix
    (["a/b/.ATTRIBUTES/VARIABLE_VALUE", "a/b/c/.ATTRIBUTES/VARIABLE_VALUE"], "'a/b'"),
    (["x", "x/y/z"], "'x'")])
def test_a_value_inside_another_is_refused_naming_both_keys(tmp_path, keys, words):
    prefix = str(tmp_path / "tf" / "ckpt")
    _bundle(prefix, [(k, np.ones(2, np.float32)) for k in keys])
    with pytest.raises(InvalidArgumentError, match="one inside the other") as info:
        convert(prefix, str(tmp_path / "ours" / "ckpt"))
    for key in keys:
        assert key in str(info.value)
    assert words in str(info.value) and "nothing was written" in str(info.value)
    assert not (tmp_path / "ours" / "ckpt.h5").exists()


def test_legacy_slots_inside_their_variable_are_refused_by_name(tmp_path):
    """A TF1 optimizer's slot lies at VARIABLE/.OPTIMIZER_SLOT/...: inside the variable's
    own value, which HDF5 cannot hold (before: HDF5's 'Unable to create group (message
    type not found)' from the layout, naming neither key)."""
    with pytest.raises(InvalidArgumentError, match=r"model/w/\.ATTRIBUTES/VARIABLE_VALUE "
                                                   r"\(object path 'model/w'\) and model/w/"
                                                   r"\.OPTIMIZER_SLOT"):
        convert(str(DATA / "slots/ckpt"), str(tmp_path / "ours" / "ckpt"))


def test_keys_that_become_one_path_without_a_graph_are_refused(tmp_path):
    """Without a graph a key is its path, less /.ATTRIBUTES/VARIABLE_VALUE: 'a/b' twice."""
    prefix = str(tmp_path / "tf" / "ckpt")
    _bundle(prefix, [("a/b", np.ones(2, np.float32)),
                     ("a/b/.ATTRIBUTES/VARIABLE_VALUE", np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match=r"become one object path here: 'a/b' from \['a/b', "
                                         r"'a/b/\.ATTRIBUTES/VARIABLE_VALUE'\]"):
        convert(prefix, str(tmp_path / "ours" / "ckpt"))
    assert not (tmp_path / "ours").exists() or not os.listdir(tmp_path / "ours")


def test_a_key_that_is_not_utf8_is_named(tmp_path):
    prefix = str(tmp_path / "tf" / "ckpt")
    _bundle(prefix, [("caf", np.ones(1, np.float32))])
    data = bytearray(open(prefix + ".index", "rb").read())
    from mpistrat.tfformats import sstable
    rows = [(b"caf\xe9" if k == b"caf" else k, v) for k, v in
            sstable.read_table(bytes(data), "x")]
    open(prefix + ".index", "wb").write(sstable.build_table(rows))
    with pytest.raises(DataLossError, match=r"ckpt\.index: a key is not UTF-8 text"):
        convert(prefix, str(tmp_path / "ours" / "ckpt"))


def test_a_kept_graph_that_does_not_match_its_crc_is_refused(tmp_path):
    _, _, ours, _ = _round_trip(tmp_path, DATA / "keras/ckpt-1")
    with h5py.File(ours + ".h5", "r+") as f:
        text = f.attrs[tf_origin.GRAPH_ATTR]
        f.attrs[tf_origin.GRAPH_ATTR] = text[:10] + ("0" if text[10] != "0" else "1") + text[11:]
    with pytest.raises(DataLossError, match="does not match its CRC-32"):
        convert(ours, str(tmp_path / "again" / "ckpt"))
    assert not (tmp_path / "again" / "ckpt.index").exists()


def test_two_values_claiming_one_key_are_refused(tmp_path):
    _, _, ours, _ = _round_trip(tmp_path, DATA / "names/tf1/model.ckpt")
    with h5py.File(ours + ".h5", "r+") as f:
        f["dense/bias"].attrs[tf_origin.TF_KEY_ATTR] = "dense/kernel"
    with pytest.raises(DataLossError, match="both claim TensorFlow key 'dense/kernel'"):
        convert(ours, str(tmp_path / "again" / "ckpt"))


def test_one_of_ours_still_gets_a_graph_of_its_paths(tmp_path):
    path = ms.Checkpoint(model={"w": np.ones(2)}).save(str(tmp_path / "ckpt"))
    convert(path, str(tmp_path / "tf" / "ckpt"))
    keys = [k for k, _ in ms.train.list_variables(str(tmp_path / "tf" / "ckpt"))]
    assert keys == [GRAPH, "model/w/.ATTRIBUTES/VARIABLE_VALUE",
                    "save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
    assert messages.parse("TrackableObjectGraph", ms.train.load_checkpoint(
        str(tmp_path / "tf" / "ckpt")).get_tensor(GRAPH), "g").nodes


def test_keys_that_differ_only_in_unicode_normalisation_stay_two_values(tmp_path):
    """Nothing normalises names (neither we, HDF5 nor TensorFlow): 'café' composed and
    decomposed are two objects, and stay two."""
    nfc, nfd = "café", unicodedata.normalize("NFD", "café")
    prefix = str(tmp_path / "tf" / "ckpt")
    _bundle(prefix, [(nfc, np.ones(2, np.float32)), (nfd, np.zeros(2, np.float32))])
    *_, back = _round_trip(tmp_path, prefix)
    assert _table(back) == _table(prefix) and len(_table(back)) == 2


def test_path_segments_take_letters_of_any_script_and_nothing_else():
    from mpistrat.checkpoint.graph import check_path
    assert check_path("model/café/重み/ключ/٣/x-1.y_2") == "model/café/重み/ключ/٣/x-1.y_2"
    for bad in ["a\n", "a b", "x/\x00", "caf\udce9", "a/./b", "€uro", "a/", "tab\t"]:
        with pytest.raises(ValueError, match="not allowed"):
            check_path(bad)


def test_a_file_whose_dataset_name_is_not_utf8_is_named(tmp_path):
    path = ms.Checkpoint(model={"w": np.ones(2)}).save(str(tmp_path / "ckpt"))
    with h5py.File(path + ".h5", "r+") as f:
        f.create_dataset(b"model/caf\xe9", data=np.ones(2))
    with pytest.raises(DataLossError, match=r"ckpt-1.h5: dataset b'model/caf\\xe9': its name "
                                            r"is not UTF-8 text"):
        ms.Checkpoint(model={"w": np.zeros(2)}).restore(path)


def test_a_tensorflow_checkpoint_of_names_that_are_not_ascii_restores_directly():
    class Module:
        pass
    model, sub = Module(), Module()
    setattr(model, "café", ms.Variable(np.zeros(3, np.float32)))
    setattr(model, "重み", ms.Variable(np.zeros((2, 3), np.int32)))
    setattr(sub, "naïve", ms.Variable(np.float64(0)))
    model.sub = sub
    model.table = {"ключ": ms.Variable(np.zeros(2, np.int64)), "plain": ms.Variable(np.float32(0))}
    ms.Checkpoint(model=model).restore(str(DATA / "names/unicode/ckpt")) \
        .assert_existing_objects_matched()
    assert getattr(model, "café").numpy().tolist() == [1.5, -2.0, 3.25]
    assert getattr(model, "重み").numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert getattr(sub, "naïve").numpy() == 0.125 and model.table["ключ"].numpy().tolist() == [7, 8]
