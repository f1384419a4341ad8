"""Batch inference: Keras 3 ``model.predict`` under a strategy (each rank predicts its block
of rows, one all_gather per output) against the same model predicting every row in each
process without a strategy (what every rank did before), in the same run.

Run: scripts/mpirun -n N .venv/bin/python benchmarks/keras_predict.py [--rows R]
Prints one JSON line: best of 3, slowest rank; ``ratio`` = sharded / whole.
"""

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

import keras  # noqa: E402

import mpistrat as ms  # noqa: E402


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(loss="mse")
    return model


def best(comm, fn, repeats=3):
    fn()  # compiles
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        out = fn()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return min(times), out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.random.default_rng(0).standard_normal((args.rows, 64)).astype(np.float32)
    whole_model = build()
    whole, expected = best(comm, lambda: whole_model.predict(x, batch_size=args.batch,
                                                             verbose=0))
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build()
    sharded, got = best(comm, lambda: model.predict(x, batch_size=args.batch, verbose=0))
    assert got.shape == expected.shape
    emit(comm, {"benchmark": "keras_predict", "ranks": comm.Get_size(), "rows": args.rows,
                "sharded_s": round(sharded, 4), "whole_s": round(whole, 4),
                "ratio": round(sharded / whole, 3),
                "max_abs_difference": float(np.abs(got - expected).max())})


if __name__ == "__main__":
    main()
