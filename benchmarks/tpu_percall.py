"""TPUStrategy.run's fixed cost as a median ratio (ours and raw back to back per repeat).

Run: XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
     scripts/mpirun -n 2 .venv/bin/python benchmarks/tpu_percall.py [--label L]

The same figures as ``tpu_bridge.py``'s ``step`` and ``dataset_step`` (see there), but each
of 15 repeats times ours and raw back to back and the figure is the median of the per-repeat
ratios, which a shared machine disturbs far less than a minimum over repeats.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402
from percall import compare  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.runtime import jax_bridge  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    parser.add_argument("--repeats", type=int, default=15)
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
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((128, 128)).astype(np.float32) * 0.05
    batches = rng.standard_normal((local, 32, 128)).astype(np.float32)

    def layer(x):
        return jnp.tanh(x @ kernel).sum(axis=1)

    raw_step = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                     check_vma=False))

    def global_batch(host):
        rows = host.reshape((-1,) + host.shape[2:])
        return jax.make_array_from_process_local_data(
            sharding, rows, (rows.shape[0] * replicas // local,) + rows.shape[1:])

    per_replica = ms.PerReplica(list(batches), strategy.extended.local_replica_ids)
    ratio, ours, raw = compare(
        comm, lambda: strategy.run(layer, args=(per_replica,)),
        lambda: raw_step(global_batch(batches)).block_until_ready(), args.repeats, inner=50)
    base = {"ranks": comm.Get_size(), "label": args.label}
    emit(comm, {"figure": "tpu_step", **base, "ours_ms": round(ours * 1e3, 3),
                "raw_ms": round(raw * 1e3, 3), "ratio": round(ratio, 3), "target": 1.15})

    steps = 40
    global_rows = rng.standard_normal((steps * 32 * replicas, 128)).astype(np.float32)
    dataset = ms.data.Dataset.from_tensor_slices(global_rows).batch(32 * replicas,
                                                                    drop_remainder=True)
    first = comm.Get_rank() * local * 32

    def raw_epoch():
        for rows in dataset:
            raw_step(global_batch(rows[first:first + local * 32][None])).block_until_ready()

    def ours_epoch():
        for batch in strategy.experimental_distribute_dataset(dataset):
            strategy.run(layer, args=(batch,))

    ratio, ours, raw = compare(comm, ours_epoch, raw_epoch, args.repeats)
    emit(comm, {"figure": "tpu_dataset_step", **base, "ours_ms": round(ours / steps * 1e3, 3),
                "raw_ms": round(raw / steps * 1e3, 3), "ratio": round(ratio, 3), "target": 1.1})


if __name__ == "__main__":
    main()
