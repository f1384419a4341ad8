"""TPUStrategy benchmark: ``strategy.run`` against raw JAX in the same run.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
     scripts/mpirun -n 2 .venv/bin/python benchmarks/tpu_bridge.py [--quick]

Figures (one JSON line each, ``ratio`` = ours / raw):

* ``step``: a small per-replica step (a 32x128 batch through a 128x128 layer),
  fed from host NumPy every step. Raw: ``make_array_from_process_local_data``
  plus a ``jax.jit`` of the same ``shard_map``; ours: ``strategy.run`` with
  a ``PerReplica`` batch (signature check over MPI, input assembly, output
  split into per-device results).
* ``dataset_step``: the same step fed by ``experimental_distribute_dataset`` (the
  next batches are laid on the devices by a prefetch thread) against a raw loop over the
  same ``ms.data`` pipeline that slices this rank's rows and builds the global array at
  each step.
* ``train_step``: a linear-model step whose gradient is summed over all
  replicas (a cross-host XLA ``psum``). Raw: parameters as explicit inputs
  and outputs; ours: an ``ms.Variable`` with ``SUM`` aggregation.
* ``resnet50_all_reduce``: ``ReplicaContext.all_reduce`` of the ResNet-50
  gradient set (161 tensors, 25.6 M floats per replica) made from the
  variables inside the step; raw: ``shard_map`` ``psum`` of the same.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import best_seconds, emit  # noqa: E402
from collectives import resnet50_shapes  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.runtime import jax_bridge  # noqa: E402


def record(comm, name, ours, raw, **extra):
    emit(comm, {"benchmark": "tpu_bridge", "figure": name, "ranks": comm.Get_size(),
                "devices_per_rank": jax_bridge.topology().num_devices_per_task,
                "ours_ms": round(ours * 1e3, 3), "raw_ms": round(raw * 1e3, 3),
                "ratio": round(ours / raw, 3), **extra})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    resolver = ms.cluster_resolver.TPUClusterResolver(tpu="")
    ms.tpu.experimental.initialize_tpu_system(resolver)
    strategy = ms.TPUStrategy(resolver)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    comm = strategy.extended.engine.comm
    mesh, axis = jax_bridge.mesh(), jax_bridge.AXIS
    sharding = NamedSharding(mesh, P(axis))
    local = len(strategy.extended.local_replica_ids)
    replicas = strategy.num_replicas_in_sync
    repeats = 3 if args.quick else 7

    def raw_program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                     check_vma=False))

    def global_batch(host):  # what a raw JAX user does each step: rows end to end
        rows = host.reshape((-1,) + host.shape[2:])
        return jax.make_array_from_process_local_data(
            sharding, rows, (rows.shape[0] * replicas // local,) + rows.shape[1:])

    # 1. a small step without cross-host communication
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((128, 128)).astype(np.float32) * 0.05
    batches = rng.standard_normal((local, 32, 128)).astype(np.float32)

    def layer(x):
        return jnp.tanh(x @ kernel).sum(axis=1)

    raw_step = raw_program(layer)
    per_replica = ms.PerReplica(list(batches), strategy.extended.local_replica_ids)
    raw = best_seconds(comm, lambda: raw_step(global_batch(batches)).block_until_ready(),
                       repeats, inner=50)
    ours = best_seconds(comm, lambda: strategy.run(layer, args=(per_replica,)), repeats,
                        inner=50)
    record(comm, "step", ours, raw)

    # 1b. the same step fed by a distributed dataset (batches prepared on the devices by a
    #     prefetch thread) against a raw loop over the same dataset that slices this rank's
    #     rows and assembles them when it needs them
    steps = 40
    global_rows = rng.standard_normal((steps * 32 * replicas, 128)).astype(np.float32)
    dataset = ms.data.Dataset.from_tensor_slices(global_rows).batch(32 * replicas,
                                                                    drop_remainder=True)
    first = comm.Get_rank() * local * 32

    def raw_epoch():  # the same pipeline; this rank's rows of each global batch, by hand
        for rows in dataset:
            raw_step(global_batch(rows[first:first + local * 32][None])).block_until_ready()

    def ours_epoch():
        for batch in strategy.experimental_distribute_dataset(dataset):
            strategy.run(layer, args=(batch,))

    def ours_epoch_with_thread():
        threaded = ms.InputOptions(experimental_per_replica_buffer_size=1)
        for batch in strategy.experimental_distribute_dataset(dataset, threaded):
            strategy.run(layer, args=(batch,))

    raw = best_seconds(comm, raw_epoch, repeats) / steps
    ours = best_seconds(comm, ours_epoch, repeats) / steps
    record(comm, "dataset_step", ours, raw, steps=steps, prefetch_thread=False)
    ours = best_seconds(comm, ours_epoch_with_thread, repeats) / steps
    record(comm, "dataset_step", ours, raw, steps=steps, prefetch_thread=True)

    # 2. a training step with a cross-host gradient psum
    x = rng.standard_normal((local, 64, 16)).astype(np.float32)
    y = rng.standard_normal((local, 64)).astype(np.float32)
    lr = np.float32(1e-3)
    with strategy.scope():
        w = ms.Variable(np.zeros(16, np.float32), aggregation=ms.VariableAggregation.SUM)

    def ours_train(features, labels):
        err = features @ w.read_value() - labels
        w.assign_sub(lr * features.T @ err)
        return (err * err).sum()

    def raw_train(params, features, labels):
        err = features @ params - labels
        grad = jax.lax.psum(features.T @ err, axis)
        return params - lr * grad, (err * err).sum()[None]

    raw_train_program = jax.jit(jax.shard_map(raw_train, mesh=mesh, in_specs=P(axis),
                                              out_specs=P(axis), check_vma=False))
    state = {"params": global_batch(np.zeros((local, 16), np.float32))}

    def raw_once():
        state["params"], loss = raw_train_program(state["params"], global_batch(x),
                                                  global_batch(y))
        jax.block_until_ready((state["params"], loss))

    xs = ms.PerReplica(list(x), strategy.extended.local_replica_ids)
    ys = ms.PerReplica(list(y), strategy.extended.local_replica_ids)
    raw = best_seconds(comm, raw_once, repeats, inner=20)
    ours = best_seconds(comm, lambda: strategy.run(ours_train, args=(xs, ys)), repeats,
                        inner=20)
    record(comm, "train_step", ours, raw)

    # 3. all-reduce of the ResNet-50 gradient set, made on the devices inside the step
    shapes = resnet50_shapes()
    with strategy.scope():
        params = [ms.Variable(np.full(s, 0.5, np.float32)) for s in shapes]
    del w
    raw_params = [p._storage for p in params]  # the same device arrays, passed explicitly
    scale = np.float32(1e-3)

    def ours_reduce():
        grads = [p.read_value() * scale for p in params]
        return ms.get_replica_context().all_reduce("SUM", grads)

    raw_reduce = raw_program(lambda ps: [jax.lax.psum(p * scale, axis) for p in ps])
    inner_repeats = 2 if args.quick else 3
    raw = best_seconds(comm, lambda: jax.block_until_ready(raw_reduce(raw_params)),
                       inner_repeats)
    ours = best_seconds(comm, lambda: strategy.run(ours_reduce), inner_repeats)
    out = strategy.run(ours_reduce)
    expected = 0.5 * 1e-3 * replicas
    assert abs(float(np.asarray(out[0].values[0]).ravel()[0]) - expected) < 1e-6
    record(comm, "resnet50_all_reduce", ours, raw, tensors=len(shapes),
           floats=int(sum(np.prod(s) for s in shapes)))


if __name__ == "__main__":
    main()
