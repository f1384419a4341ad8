"""Hostile files and bad arguments, checked without MPI traffic (one process).

Crafted checkpoint files and state files, record and .npy files made here:
each must end in a named error before anything large is allocated, and never
read or delete anything outside the checkpoint directory.
"""

import os

import h5py
import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint.graph import collect_slots
from mpistrat.checkpoint.state_file import read_state
from mpistrat.checkpoint.validate import check_checksums, check_dtype, check_partitions
from mpistrat.errors import DataLossError


class Model:
    def __init__(self, n=5):
        self.w = ms.Variable(np.arange(float(n)))


def _good(tmp_path, name="ckpt"):
    model = Model()
    ckpt = ms.Checkpoint(model=model)
    return model, ckpt, ckpt.save(str(tmp_path / name))


def _rewrite(path, name, data=None, **attrs):
    """Replace dataset ``name`` of an existing checkpoint with crafted content."""
    with h5py.File(path, "r+") as f:
        old = dict(f[name].attrs)
        del f[name]
        dset = f.create_dataset(name, data=data) if data is not None else None
        return f, dset, old


# -- pure validation -----------------------------------------------------------------------
@pytest.mark.parametrize("parts,rows,match", [
    ([(0, 3), (2, 5)], 5, "starts at row 2"),        # overlap
    ([(0, 2), (3, 5)], 5, "starts at row 3"),        # gap
    ([(0, 2)], 5, "end at row 2"),                   # short
    ([(0, 6)], 5, "end at row 6"),                   # long
    ([], 5, "0 partitions"),
    ([(0, 0), (0, 5)], 5, "empty"),
])
def test_partitions_must_tile_the_rows(parts, rows, match):
    with pytest.raises(DataLossError, match=match):
        check_partitions(parts, rows, "f.h5, 'w'")


def test_checksums_one_per_partition_and_dtypes_whitelisted():
    assert check_checksums([1, 2], 2, "x") == [1, 2]
    with pytest.raises(DataLossError, match="0 checksums for 2 partitions"):
        check_checksums([], 2, "x")
    for bad in [h5py.vlen_dtype(np.int32), np.dtype([("a", "i4"), ("b", "f4")]), np.dtype("O"),
                np.dtype("S4"), np.dtype("V2"), np.dtype("M8[s]")]:
        with pytest.raises(DataLossError, match="not allowed"):
            check_dtype(bad, "x")
    assert check_dtype(np.dtype("float16"), "x") == np.float16
    assert check_dtype(np.dtype(">f8"), "x") == np.dtype(">f8")  # HDF5 records the byte order


def test_a_crafted_mpistrat_dtype_is_data_loss():
    from mpistrat.checkpoint.dtypes import logical_dtype
    import ml_dtypes
    assert logical_dtype(np.dtype("uint16"), "bfloat16", "x") == ml_dtypes.bfloat16
    assert logical_dtype(np.dtype("int64"), b"datetime64[ns]", "x") == np.dtype("M8[ns]")
    for stored, name in [(np.dtype("int32"), "bfloat16"), (np.dtype("uint8"), "bfloat16"),
                         (np.dtype("uint16"), "object"), (np.dtype("uint8"), "datetime64[ns]"),
                         (np.dtype("uint64"), "datetime64[ns]"), (np.dtype("int64"), 7),
                         (np.dtype("int64"), "datetime64[ns];rm")]:
        with pytest.raises(DataLossError, match="x"):
            logical_dtype(stored, name, "x")


# -- crafted checkpoint files --------------------------------------------------------------
def test_external_storage_is_refused(tmp_path):
    model, ckpt, path = _good(tmp_path)
    secret = tmp_path / "secret.bin"
    np.arange(5.0).tofile(secret)
    with h5py.File(path + ".h5", "r+") as f:
        attrs = dict(f["model/w"].attrs)
        del f["model/w"]
        dset = f.create_dataset("model/w", shape=(5,), dtype="f8",
                                external=[(str(secret), 0, h5py.h5f.UNLIMITED)])
        dset.attrs.update(attrs)
    with pytest.raises(DataLossError, match="external storage"):
        ckpt.restore(path)


def test_foreign_virtual_dataset_is_refused(tmp_path):
    model, ckpt, path = _good(tmp_path)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(5.0)
    with h5py.File(path + ".h5", "r+") as f:
        attrs = dict(f["model/w"].attrs)
        del f["model/w"]
        layout = h5py.VirtualLayout(shape=(5,), dtype="f8")
        layout[:] = h5py.VirtualSource(str(other), "x", shape=(5,))
        f.create_virtual_dataset("model/w", layout).attrs.update(attrs)
    with pytest.raises(DataLossError, match="not one of this checkpoint's part files"):
        ckpt.restore(path)


def test_empty_checksum_list_and_bad_partitions_are_refused(tmp_path):
    model, ckpt, path = _good(tmp_path)
    with h5py.File(path + ".h5", "r+") as f:
        f["model/w"].attrs["mpistrat_checksums"] = np.zeros(0, dtype=np.uint32)
    with pytest.raises(DataLossError, match="0 checksums for 1 partitions"):
        ckpt.restore(path)
    with h5py.File(path + ".h5", "r+") as f:
        f["model/w"].attrs["mpistrat_checksums"] = np.zeros(2, dtype=np.uint32)
        f["model/w"].attrs["mpistrat_partitions"] = np.array([[0, 3], [2, 5]], dtype=np.int64)
    with pytest.raises(DataLossError, match="partition 1 starts at row 2"):
        ckpt.restore(path)


def test_huge_claim_in_a_small_file_is_refused_before_allocating(tmp_path):
    model, ckpt, path = _good(tmp_path)
    with h5py.File(path + ".h5", "r+") as f:
        attrs = dict(f["model/w"].attrs)
        del f["model/w"]
        rows = (2 << 30) // 8  # 2 GiB of float64, never written (late allocation)
        dset = f.create_dataset("model/w", shape=(rows,), dtype="f8")
        attrs["mpistrat_partitions"] = np.array([[0, rows]], dtype=np.int64)
        dset.attrs.update(attrs)
    assert os.path.getsize(path + ".h5") < 64 << 10
    with pytest.raises(DataLossError, match="claims 2147483648 bytes"):
        ckpt.restore(path)
    # and a truncated file: the bytes the dataset claims are no longer there
    model2, ckpt2, path2 = _good(tmp_path, "trunc")
    size = os.path.getsize(path2 + ".h5")
    os.truncate(path2 + ".h5", size - 20)
    with pytest.raises(DataLossError, match="truncated|could not be read"):
        ckpt2.restore(path2)


def test_shape_mismatch_is_named_before_reading(tmp_path):
    model, ckpt, path = _good(tmp_path)
    other = ms.Checkpoint(model=Model(n=7))
    with pytest.raises(ValueError, match=r"'model/w'.*float64\[5\].*float64\[7\]"):
        other.restore(path)


@pytest.mark.parametrize("dtype", [h5py.vlen_dtype(np.int64), np.dtype([("a", "<i8")]),
                                   h5py.string_dtype()])
def test_vlen_compound_and_string_values_never_reach_objects(tmp_path, dtype):
    model, ckpt, path = _good(tmp_path)
    with h5py.File(path + ".h5", "r+") as f:
        attrs = dict(f["model/w"].attrs)
        del f["model/w"]
        f.create_dataset("model/w", shape=(5,), dtype=dtype).attrs.update(attrs)
    with pytest.raises(DataLossError, match="is not allowed in a checkpoint"):
        ckpt.restore(path)
    assert model.w.numpy().tolist() == [0, 1, 2, 3, 4]


def test_missing_part_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MPISTRAT_CHECKPOINT_MODE", "parts")
    model, ckpt, path = _good(tmp_path)
    part = [n for n in os.listdir(tmp_path) if ".part-" in n][0]
    os.remove(tmp_path / part)
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)  # a same-named file in the working directory must not be used
    (other / part).write_bytes(b"not the part")
    with pytest.raises(ms.errors.NotFoundError, match=f"part file .*{part} of checkpoint"):
        ckpt.restore(path)


# -- state files ---------------------------------------------------------------------------
def test_state_file_paths_outside_are_neither_read_nor_deleted(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir(), victim.mkdir()
    for name in ["important", "data.h5"]:
        (victim / name).write_bytes(b"precious")
    outside = tmp_path / "outside"
    outside.mkdir()
    model = Model()
    ms.Checkpoint(model=Model(n=5)).write(str(outside / "x"))   # a valid checkpoint outside
    (run / "checkpoint").write_text(
        'model_checkpoint_path: "../outside/x"\n'
        'all_model_checkpoint_paths: "../victim/important"\n'
        f'all_model_checkpoint_paths: "{victim}/data"\n'
        'all_model_checkpoint_paths: "../victim/data.h5"\n')
    with pytest.warns(RuntimeWarning, match="outside the directory"):
        assert ms.latest_checkpoint(str(run)) is None
    with pytest.warns(RuntimeWarning):
        manager = ms.CheckpointManager(ms.Checkpoint(model=model), str(run), max_to_keep=1)
    assert manager.restore_or_initialize() is None
    for _ in range(3):
        manager.save()
    assert sorted(os.listdir(victim)) == ["data.h5", "important"]
    assert all((victim / n).read_bytes() == b"precious" for n in os.listdir(victim))
    assert ms.latest_checkpoint(str(run)) == str(run / "ckpt-3")


@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe\x00binary\x80", "damaged or not a state file"),
    (b'model_checkpoint_path: "ckpt-1"\nall_model_checkpoint_timestamps: nan\n', "finite"),
    (b"x" * ((1 << 20) + 1), "larger than"),
])
def test_damaged_state_files_raise_data_loss_naming_the_file(tmp_path, content, match):
    (tmp_path / "checkpoint").write_bytes(content)
    with pytest.raises(DataLossError, match=match) as info:
        read_state(str(tmp_path))
    assert str(tmp_path / "checkpoint") in str(info.value)
    with pytest.raises(DataLossError):
        ms.latest_checkpoint(str(tmp_path))


def test_keys_that_collide_as_path_segments_are_refused():
    with pytest.raises(ValueError, match="keys 1 and '1' both save"):
        collect_slots({"table": {1: np.zeros(2), "1": np.ones(2)}})


# -- record and .npy readers ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(record_bytes=0), "record_bytes must be positive"),
    (dict(record_bytes=-4), "record_bytes must be positive"),
    (dict(record_bytes=4, footer_bytes=-16), "must not be negative"),
    (dict(record_bytes=4, header_bytes=-8), "must not be negative"),
    (dict(record_bytes=4, dtype="O"), "not supported"),
    (dict(record_bytes=4, dtype="float32", shape=(0,)), "cannot hold"),
])
def test_record_reader_arguments(tmp_path, kwargs, match):
    path = tmp_path / "r.bin"
    np.arange(8, dtype=np.int32).tofile(path)
    with pytest.raises(ValueError, match=match):
        ms.data.FixedLengthRecordDataset([str(path)], **kwargs)


def test_truncated_record_file_is_a_short_read(tmp_path):
    path = tmp_path / "r.bin"
    np.arange(1000, dtype=np.int32).tofile(path)
    ds = ms.data.FixedLengthRecordDataset([str(path)], record_bytes=4, dtype=np.int32)
    os.truncate(path, 400)  # after the dataset was built
    with pytest.raises(DataLossError, match=r"short read at offset 0: 400 of 4000 bytes"):
        list(ds.batch(1000))


def _npy_with_header(path, shape, dtype="<f4", body_items=None):
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    with open(path, "wb") as handle:
        np.lib.format.write_array_header_1_0(handle, header)
        count = body_items if body_items is not None else int(np.prod(shape))
        np.zeros(max(count, 0), dtype=dtype).tofile(handle)


@pytest.mark.parametrize("shape,body,match", [
    ((10, 3), 20, "the file holds"),           # header claims more than the file has
    ((10, 3), 40, "the file holds"),           # trailing bytes
    ((10, 0), 0, "positive sizes"),
    ((-2, 3), 0, "positive sizes"),
    ((), 1, "needs a first axis"),
])
def test_npy_headers_are_checked_against_the_file(tmp_path, shape, body, match):
    path = tmp_path / "x.npy"
    _npy_with_header(path, shape, body_items=body)
    with pytest.raises(ValueError, match=match):
        ms.data.NpyDataset([str(path)])


def test_hdf5_reader_refuses_vlen_and_strings(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", shape=(4,), dtype=h5py.vlen_dtype(np.float32))
        f.create_dataset("s", data=np.array([b"ab", b"cd"]))
    for name in ["v", "s"]:
        with pytest.raises(ValueError, match="not supported"):
            ms.data.HDF5Dataset([str(path)], name)


def test_validation_cache_is_bounded():
    from mpistrat.collectives import validation
    for n in range(validation._MAX_CACHED + 500):
        validation._hash((("float32", (n,)),))
    assert len(validation._HASHES) <= validation._MAX_CACHED


def test_fault_hook_is_inert_unless_armed_for_tests():
    from mpistrat.runtime import faults
    assert os.environ.get("MPISTRAT_TEST_FAULT") is None
    assert faults.fault_point is faults._disarmed
    faults.fault_point("checkpoint-partition-written")  # returns: nothing is armed


def test_standard_hdf5_tools_read_a_checkpoint(tmp_path):
    import shutil
    import subprocess
    if not shutil.which("h5dump"):
        pytest.skip("h5dump is missing (Debian package hdf5-tools)")
    model, ckpt, path = _good(tmp_path)
    out = subprocess.run(["h5dump", "-d", "model/w", path + ".h5"], capture_output=True,
                         text=True, check=True).stdout
    assert "mpistrat_partitions" in out and "0, 1, 2, 3, 4" in out, out


def test_values_without_an_object_are_not_read_until_one_is_attached(tmp_path):
    model, ckpt, path = _good(tmp_path)
    with h5py.File(path + ".h5", "r+") as f:  # 256 MiB claimed, sparse on disk
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        junk = f.create_dataset("junk", shape=(32 << 20,), dtype="f8", dcpl=dcpl)
        junk.attrs.update({"mpistrat_kind": "array", "mpistrat_checksums": np.zeros(1, "u4"),
                           "mpistrat_partitions": np.array([[0, 32 << 20]], dtype=np.int64)})
    fresh = ms.Checkpoint(model=Model())
    status = fresh.restore(path)
    assert status.unmatched_values == {"junk"}
    assert not any(isinstance(v, np.ndarray) for v in fresh._pending.remaining.values())
    with pytest.raises(ValueError, match=r"'junk'.*float64\[33554432\].*float64\[3\]"):
        fresh.junk = np.zeros(3)  # checked against the object before anything is read


def test_numbers_restore_only_from_scalars_of_their_kind(tmp_path):
    ms.Checkpoint(step=np.arange(5), lr=3.7, flag=True).write(str(tmp_path / "a"))
    for name, target, match in [("step", 3, r"'step'.*int64\[5\].*int number"),
                                ("lr", 3, r"'lr'.*float64\[\].*int number"),
                                ("flag", 1.0, r"'flag'.*bool\[\].*float number")]:
        with pytest.raises(ValueError, match=match):
            ms.Checkpoint(**{name: target}).read(str(tmp_path / "a"))
    holder = ms.Checkpoint(lr=0.0)
    holder.read(str(tmp_path / "a")).expect_partial()
    assert holder.lr == 3.7


def test_a_fifo_or_foreign_state_file_is_refused_not_waited_on_or_overwritten(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "checkpoint")
    with pytest.raises(DataLossError, match="not a regular file"):
        ms.latest_checkpoint(str(fifo))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "checkpoint").write_text("my notes: do not lose\n")
    with pytest.raises(DataLossError, match="damaged or not a state file"):
        ms.Checkpoint(w=ms.Variable(np.zeros(2))).save(str(notes / "ckpt"))
    assert (notes / "checkpoint").read_text() == "my notes: do not lose\n"
