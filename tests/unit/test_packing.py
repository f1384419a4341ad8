"""Pure parts of the fused path: runs of equal shapes and the cached plan."""

import numpy as np

from mpistrat.collectives.packing import FusedPlan, runs_of, wire_dtype
from mpistrat.collectives.reduce_op import ReduceOp


def test_runs_group_consecutive_equal_shapes_only():
    assert runs_of([0, 1, 2, 5], [(4,), (4,), (2, 2), (4,)], [4, 4, 4, 4]) == [
        (0, 2, (4,), 0, 8), (2, 1, (2, 2), 8, 12), (5, 1, (4,), 12, 16)]
    assert runs_of([3, 4], [(1,), (1,)], [1, 1]) == [(3, 2, (1,), 0, 2)]
    assert runs_of([], [], []) == []


def test_plan_buckets_runs_and_conversions():
    f4, f2, b = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.bool_)
    signature = [(f4, (256,))] * 3 + [(f2, (256,)), (b, (3,)), (f4, (1 << 20,))]
    plan = FusedPlan(signature, 4 << 20, ReduceOp.MAX)
    fused = [bk for bk in plan.buckets if bk.fused]
    alone = [bk for bk in plan.buckets if not bk.fused]
    assert [bk.indices for bk in fused] == [(0, 1, 2, 3)]     # float16 travels as float32
    assert fused[0].converts and fused[0].span == (0, 4)
    assert [r[:3] for r in fused[0].runs] == [(0, 3, (256,)), (3, 1, (256,))]
    assert [bk.indices for bk in alone] == [(4,), (5,)]
    assert wire_dtype(b) == np.uint8 and wire_dtype(f2) == np.float32 and wire_dtype(f4) == f4


def test_wire_dtypes_of_types_mpi_lacks_and_of_integer_means():
    import ml_dtypes
    for low in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float16):
        assert wire_dtype(np.dtype(low), ReduceOp.SUM) == np.float32
    assert wire_dtype(np.dtype(np.uint8), ReduceOp.MEAN) == np.uint64
    assert wire_dtype(np.dtype(np.int16), ReduceOp.MEAN) == np.int64
    assert wire_dtype(np.dtype(np.int16), ReduceOp.SUM) == np.int32   # (Open MPI's op/avx
    assert wire_dtype(np.dtype(np.uint8), ReduceOp.SUM) == np.uint32  # saturates them)
    assert wire_dtype(np.dtype(np.int32), ReduceOp.SUM) == np.int32
    assert wire_dtype(np.dtype(np.int16), ReduceOp.MAX) == np.int16
    assert wire_dtype(np.dtype(">f8"), ReduceOp.SUM) == np.dtype("<f8")
    plan = FusedPlan([(np.dtype(ml_dtypes.bfloat16), (4,)), (np.dtype(np.float32), (4,))],
                     4 << 20, ReduceOp.MEAN)
    assert [bk.indices for bk in plan.buckets] == [(0, 1)] and plan.buckets[0].converts
    import pytest
    with pytest.raises(TypeError, match="bool"):
        FusedPlan([(np.dtype(bool), (2,))], 4 << 20, ReduceOp.SUM)


def test_bfloat16_bit_conversions_match_ml_dtypes_exactly():
    import ml_dtypes
    from mpistrat.collectives.dtypes import from_wire, to_wire
    bf16, f32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
    every = np.arange(1 << 16, dtype=np.uint16).view(bf16)           # every bfloat16 value
    wide = to_wire(every, f32)
    np.testing.assert_array_equal(wide.view(np.uint32), every.astype(f32).view(np.uint32))
    bits = np.random.default_rng(7).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
    values = bits.astype(np.uint32).view(f32)                          # any float32, NaN too
    narrow, reference = from_wire(values, bf16), values.astype(bf16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(narrow.view(np.uint16)[finite], reference.view(np.uint16)[finite])
    assert np.isnan(narrow[~finite].astype(f32)).all()
    assert from_wire(np.array(2.5, f32), bf16).shape == ()
    assert to_wire(np.ones((4, 3), bf16)[:, ::2], f32).shape == (4, 2)


def test_refuse_names_the_first_refused_tensor_of_a_long_list_and_passes_a_clean_one():
    """Each distinct dtype is judged once; the error still names the first refused tensor
    by its place in the nest, whatever dtypes come before and after it."""
    import pytest
    from mpistrat.collectives.backends.base import DeviceBufferRefused, refuse_device_buffers
    from mpistrat.collectives.dtypes import refuse
    from mpistrat.collectives.structure import leaf_names
    floats = [np.zeros(3, np.float32) for _ in range(1000)]
    refuse("all_reduce SUM", floats, ReduceOp.SUM, lambda: leaf_names(floats))         # nothing to refuse
    refuse_device_buffers(floats, "host-mpi")
    mixed = {"a": floats[:5], "b": np.zeros(2, np.complex64), "c": np.zeros(2, bool)}
    leaves = floats[:5] + [mixed["b"], mixed["c"]]
    with pytest.raises(TypeError, match=r"all_reduce SUM: .*c.*does not apply to bool"):
        refuse("all_reduce SUM", leaves, ReduceOp.SUM, lambda: leaf_names(mixed))
    with pytest.raises(TypeError, match=r"all_reduce MAX: .*b.*no order for complex"):
        refuse("all_reduce MAX", leaves, ReduceOp.MAX, lambda: leaf_names(mixed))
    refuse("all_gather axis=0", leaves, None, lambda: leaf_names(mixed))     # a gather moves bits: all go
    objects = [np.zeros(1), np.zeros(1, object)]
    with pytest.raises(TypeError, match=r"\[1\]: object values cannot travel"):
        refuse("all_gather axis=0", objects, None, lambda: leaf_names(objects))

    class Device:   # any array exposing CUDA's interface, among NumPy arrays
        __cuda_array_interface__ = {}
    with pytest.raises(DeviceBufferRefused, match="tensor 1000"):
        refuse_device_buffers(floats + [Device()], "host-mpi")
