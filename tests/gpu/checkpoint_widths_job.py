"""Checkpoints of device arrays saved at one width and restored at another (scripts/gpu_check.sh).

    scripts/mpirun -n 2 PYTHON tests/gpu/checkpoint_widths_job.py save DIR --kinds cupy,jax
    scripts/mpirun -n 1 PYTHON tests/gpu/checkpoint_widths_job.py restore DIR --kinds cupy,jax

For each kind: a mirrored variable made from an array of that kind and a container holding
arrays of that kind. ``restore`` starts from zeros of the same kind, restores, and checks every
value bit for bit, its kind and its device (the GPU when there is one). Prints one line per
check and exits 1 if any failed. ``--kinds jax`` runs on a CPU machine too (JAX CPU arrays).
"""

import argparse
import os
import sys

import numpy as np

import mpistrat as ms
from mpistrat.runtime import get_world
from mpistrat.runtime.devices import array_kind


def module(kind):
    if kind == "cupy":
        import cupy
        return cupy
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    return jnp


def originals(kind):
    rng = np.random.default_rng(sum(map(ord, kind)))
    return {"kernel": rng.standard_normal((1000, 33)),          # 264 kB: a partition per rank
            "steps": rng.integers(0, 1 << 30, 17).astype(np.int64),
            "half": rng.standard_normal(9).astype(np.float16)}


def host(value):
    return value.get() if array_kind(value) == "cupy" else np.asarray(value)


def on_device(value, kind) -> str:
    """Where the value lives, in words ('' when that is where it should be)."""
    if kind == "cupy":
        import cupy
        return "" if value.device.id == cupy.cuda.Device().id else f"device {value.device.id}"
    import jax
    platforms = {d.platform for d in value.devices()}
    want = jax.default_backend()
    return "" if platforms == {want} else f"on {platforms}, not {want}"


def objects(strategy, kinds, zeros):
    made = {}
    for kind in kinds:
        xp, values = module(kind), originals(kind)
        if zeros:
            values = {k: np.zeros_like(v) for k, v in values.items()}
        with strategy.scope():
            variable = ms.Variable(xp.asarray(values["kernel"]))
        made[kind] = {"variable": variable,
                      "container": {k: xp.asarray(v) for k, v in values.items()}}
    return made


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["save", "restore"])
    parser.add_argument("directory")
    parser.add_argument("--kinds", default="cupy,jax")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    world, strategy = get_world(), ms.MultiWorkerMirroredStrategy()
    made = objects(strategy, kinds, zeros=args.action == "restore")
    checkpoint = ms.Checkpoint(**made)
    if args.action == "save":
        path = checkpoint.save(os.path.join(args.directory, "ckpt"))
        if world.rank == 0:
            print(f"saved at {world.size} ranks: {path}", flush=True)
        return 0
    path = ms.latest_checkpoint(args.directory)
    checkpoint.restore(path).assert_consumed()
    failed = 0
    for kind in kinds:
        want = originals(kind)
        checks = [("variable", made[kind]["variable"].numpy(), want["kernel"], None)]
        checks += [(f"container/{k}", host(v), want[k], v)
                   for k, v in made[kind]["container"].items()]
        for name, got, expected, value in checks:
            problems = []
            if got.dtype != expected.dtype or got.tobytes() != expected.tobytes():
                problems.append("values differ")
            if value is not None and array_kind(value) != kind:
                problems.append(f"came back as {type(value).__module__}")
            elif value is not None and on_device(value, kind):
                problems.append(on_device(value, kind))
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'OK'} {kind} {name} restored at {world.size} "
                  f"rank(s) from {path}{': ' + ', '.join(problems) if problems else ''}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
