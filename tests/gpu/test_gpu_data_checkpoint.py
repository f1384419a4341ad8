"""CuPy values in checkpoints (saved from the GPU, restored onto it) and dataset batches
fetched to the GPU."""

import os

import numpy as np

import mpistrat as ms


def test_checkpoint_round_trip_restores_onto_the_device(strategy, world, shared_dir):
    import cupy
    with strategy.scope():
        w = ms.Variable(cupy.arange(6, dtype=cupy.float32).reshape(2, 3))
    raw = cupy.full(5, 7.0)
    ckpt = ms.Checkpoint(w=w, state={"raw": raw})
    path = ckpt.save(os.path.join(shared_dir, "ckpt"))
    w.assign(cupy.zeros((2, 3), cupy.float32))
    raw[...] = 0
    ckpt.restore(path).assert_consumed()
    assert isinstance(w.read_value(), cupy.ndarray)
    assert w.numpy().ravel().tolist() == list(range(6))
    assert raw.tolist() == [7.0] * 5 and raw.device.id == cupy.cuda.Device().id
    import h5py
    if world.rank == 0:  # the file is plain HDF5, readable without mpistrat
        with h5py.File(path + ".h5", "r") as handle:
            names = []
            handle.visit(names.append)
            assert any("w" in name for name in names)


def test_dataset_batches_are_fetched_to_the_gpu(strategy, world):
    import cupy
    dataset = ms.data.Dataset.range(8 * world.size).batch(4 * world.size)
    seen = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        local = strategy.experimental_local_results(batch)[0]
        assert isinstance(local, cupy.ndarray)
        seen.extend(local.tolist())
    assert seen == [s * 4 * world.size + world.rank * 4 + k for s in range(2) for k in range(4)]
    host = ms.InputOptions(experimental_fetch_to_device=False)
    first = next(iter(strategy.experimental_distribute_dataset(dataset, host)))
    assert isinstance(strategy.experimental_local_results(first)[0], np.ndarray)
