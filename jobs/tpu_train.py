"""TPUStrategy job: linear regression on every JAX device of every rank, with checkpoints.

Each rank is one JAX host. On CPU machines give each host virtual devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        scripts/mpirun -n 2 .venv/bin/python jobs/tpu_train.py --dir /tmp/tpu-run --epochs 3

Run it again with the same ``--dir`` and it resumes from the latest checkpoint
(model, step counter and dataset position). On a TPU or GPU host JAX finds the
accelerators itself; the code is the same.
"""

import argparse

import numpy as np

import mpistrat as ms


def make_data(rows: int = 512, features: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    true_w = np.linspace(-1.0, 1.0, features, dtype=np.float32)
    return x, (x @ true_w + 0.25).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by all ranks)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-per-replica", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    resolver = ms.cluster_resolver.TPUClusterResolver(tpu="")
    ms.config.experimental_connect_to_cluster(resolver)
    topology = ms.tpu.experimental.initialize_tpu_system(resolver)
    strategy = ms.TPUStrategy(resolver)
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync

    x, y = make_data()
    with strategy.scope():
        w = ms.Variable(np.zeros(x.shape[1], np.float32), aggregation=ms.VariableAggregation.SUM,
                        name="w")
        b = ms.Variable(np.float32(0.0), aggregation=ms.VariableAggregation.SUM, name="b")
        step = ms.Variable(0, dtype=np.int64, name="step")
    dataset = ms.data.Dataset.from_tensor_slices((x, y)).batch(global_batch,
                                                                 drop_remainder=True)
    checkpoint = ms.Checkpoint(model={"w": w, "b": b}, step=step)
    manager = ms.CheckpointManager(checkpoint, args.dir, max_to_keep=2)
    resumed = manager.restore_or_initialize()

    def train_step(features, labels):
        err = features @ w.read_value() + b.read_value() - labels
        w.assign_sub(args.lr * 2 * (features.T @ err) / global_batch)  # SUM over replicas
        b.assign_sub(args.lr * 2 * err.sum() / global_batch)
        return (err * err).sum()

    for epoch in range(args.epochs):
        total = 0.0
        for features, labels in strategy.experimental_distribute_dataset(dataset):
            per_replica_loss = strategy.run(train_step, args=(features, labels))
            total += float(strategy.reduce("SUM", per_replica_loss, axis=None))
            step.assign_add(1)
        path = manager.save()
        if strategy.extended.should_checkpoint:
            print(f"epoch {epoch}: loss {total / len(x):.5f}, step {int(step.numpy())}, hosts "
                  f"{topology.num_tasks} x {topology.num_devices_per_task} "
                  f"{topology.platform} devices, resumed={resumed is not None}, saved {path}",
                  flush=True)
    if strategy.extended.should_checkpoint:
        print(f"final w {[round(float(v), 3) for v in w.numpy()]} b {float(b.numpy()):.3f}",
              flush=True)


if __name__ == "__main__":
    main()
