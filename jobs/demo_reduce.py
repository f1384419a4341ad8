"""Demo job: every rank contributes its replica id; all ranks print the reduced values.

Run: scripts/mpirun -n 2 .venv/bin/python jobs/demo_reduce.py
"""

import numpy as np

import mpistrat as ms


def main() -> None:
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        weights = ms.Variable(np.zeros(4), aggregation=ms.VariableAggregation.MEAN, name="w")

    def step(scale):
        ctx = ms.get_replica_context()
        grad = np.full(4, float(ctx.replica_id_in_sync_group)) * scale
        weights.assign_sub(grad)          # MEAN: every replica applies the average
        return ctx.replica_id_in_sync_group

    ids = strategy.run(step, args=(1.0,))
    total = strategy.reduce("SUM", ids, axis=None)
    gathered = strategy.gather(np.array([ids]), axis=0)
    print(f"[rank {ids}] replicas={strategy.num_replicas_in_sync} sum of replica ids={total} "
          f"gathered={gathered.tolist()} weights={weights.numpy().tolist()}", flush=True)


if __name__ == "__main__":
    main()
