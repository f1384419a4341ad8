"""What the ranks must agree on, and what is refused, before Keras trains under a strategy.

Pure checks of ``fit``'s arguments and collective agreements (every rank raises together):

* ``same_arrays_everywhere``: under a strategy every rank passes the same arrays (the global
  data); a rank that passed other rows is named, before anything trains;
* ``same_steps_everywhere``: with each rank's own data (Horovod's contract) every rank makes
  the same number of steps, else each rank's count is named (Horovod would hang);
* ``agreed_batches``: each rank's own Python generator (its length unknown until it runs
  dry) yields a batch only when every rank's has one; when some run dry before the others,
  every rank raises naming each rank's count (Horovod would hang);
* ``loss_rule``: how the replicas' gradients combine for the compiled losses (a mean, or
  ``reduction="sum"`` by TensorFlow's rule), and the reductions refused by name;
* ``_split_off``: Keras's ``validation_split`` on arrays, the last rows held out::

    x, y, w, held = _split_off(x, y, None, 0.25)
"""

import math
from typing import Any

import numpy as np

__all__ = ["same_arrays_everywhere", "same_steps_everywhere", "agreed_batches",
           "loss_rule"]


def _rows(tree) -> int:
    import jax
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if leaf is not None]
    return int(np.shape(leaves[0])[0]) if leaves else 0


def _is_arrays(x) -> bool:
    import types

    import jax
    if isinstance(x, (types.GeneratorType, types.AsyncGeneratorType)):
        return False   # (JAX deprecates taking a generator as a pytree leaf)
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(isinstance(leaf, np.ndarray) or type(leaf).__module__.startswith(
        "jax") for leaf in leaves)


def same_arrays_everywhere(strategy: Any, arrays) -> None:
    """Every rank passed the same arrays to ``fit``/``evaluate`` (collective): their shapes,
    dtypes and a digest of a spread of rows agree, else ``ValueError`` on every rank naming
    what each saw. Arrays are the global data: each rank takes its slice of every global
    batch, so a rank that passed its own rows would silently train on others' rows."""
    import hashlib
    import jax
    from mpistrat.collectives.agreement import agree_view
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(arrays)]
    digest = hashlib.blake2b(digest_size=8)
    for leaf in leaves:
        rows = leaf.shape[0] if leaf.ndim else 0
        picks = np.unique(np.linspace(0, rows - 1, min(rows, 65)).astype(np.int64))
        sample = leaf[picks] if rows else leaf
        digest.update(repr(sample.tolist()).encode() if sample.dtype.kind == "O"   # (strings:
                      else np.ascontiguousarray(sample).tobytes())          # not pointers)
    view = ([f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves], digest.hexdigest())
    agree_view(strategy.extended.engine, view, "the arrays given to model.fit/evaluate "
               "(shapes and dtypes, a digest of their rows)", error=ValueError,
               hint="under a strategy every rank passes the same arrays (the global data) and "
                    "trains on its slice of every global batch; to give each rank its own "
                    "rows, pass strategy.distribute_datasets_from_function(...) instead")


def same_steps_everywhere(strategy: Any, data: Any, steps: Any, what: str) -> None:
    """Per-rank data (Horovod's contract): every rank makes the same number of steps, else
    ``ValueError`` on every rank naming each rank's count (collective). A rank with fewer
    batches would leave the others waiting in the gradient all-reduce forever."""
    try:
        batches = len(data)
    except TypeError:   # a generator or dataset of unknown length: the user's steps decide
        batches = -1
    counts = strategy.extended.engine.all_gather(
        np.array([batches, -1 if steps is None else int(steps)]), 0).reshape(-1, 2)
    known, asked = counts[:, 0], set(counts[:, 1].tolist())
    if len(asked) > 1:
        raise ValueError(f"model.{what}: the ranks were given different step counts "
                         f"({counts[:, 1].tolist()}, -1 = none); pass the same on every rank")
    steps = asked.pop()
    lengths = known[known >= 0]
    if steps >= 0:
        short = lengths.size and int(lengths.min()) < steps
    else:
        short = (known >= 0).all() and len(set(lengths.tolist())) > 1
    if short and len(set(lengths.tolist())) == 1 and (known >= 0).all():
        step_name = {"fit": "steps_per_epoch", "validation": "validation_steps"}.get(what,
                                                                                  "steps")
        raise ValueError(
            f"model.{what} with each rank's own data: {step_name}={steps} is larger than the "
            f"{int(lengths.min())} batches every rank has, so every rank would run out of "
            f"data before the {step_name} ends; pass {step_name} <= {int(lengths.min())} (or "
            f"none: one pass over the data), or give each rank more rows")
    if short:
        per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(known))
        asked_text = f" for {steps} steps" if steps >= 0 else ""
        raise ValueError(
            f"model.{what} with each rank's own data: the ranks have different numbers of "
            f"batches ({per_rank}){asked_text}, so the ranks with more would wait forever in "
            f"the gradient all-reduce; give every rank as many rows (e.g. shard with "
            f"x[hvd.rank()::hvd.size()] over a row count that hvd.size() divides), or pass a "
            f"step count no rank exceeds (<= {int(lengths.min())})")


def agreed_batches(strategy: Any, data: Any, what: str) -> Any:
    """``data`` as it is, unless it is a Python generator (per-rank data, Horovod's contract):
    then a generator that, before each batch, agrees with every rank whether each has one
    (one small all-gather per batch). All have one: it is yielded; none: the epoch ends on
    every rank together; some but not all: ``ValueError`` on every rank naming each rank's
    count (where the ranks with more would wait forever in the gradient all-reduce)."""
    import types
    if not isinstance(data, types.GeneratorType):
        return data
    engine = strategy.extended.engine
    label = f"model.{what}: whether each rank's generator has a next batch"

    def batches():
        taken = 0
        while True:
            try:
                batch, has = next(data), 1
            except StopIteration:
                batch, has = None, 0
            flags = np.asarray(engine.all_gather(np.array([has], np.int64), 0,
                                                 label=label)).reshape(-1)
            if flags.all():
                taken += 1
                yield batch
                continue
            if not flags.any():
                return
            per_rank = ", ".join(f"rank {r}: {taken}" if not f else
                                 f"rank {r}: more than {taken}" for r, f in enumerate(flags))
            raise ValueError(
                f"model.{what} with each rank's own generator: the ranks' generators give "
                f"different numbers of batches ({per_rank}), so the ranks with more would "
                f"wait forever in the gradient all-reduce (Horovod hangs here); give every "
                f"rank's generator as many batches, or pass a step count (steps_per_epoch, "
                f"validation_steps, steps) that every rank's generator can give")

    return batches()


def _split_off(x, y, sample_weight, fraction: float):
    """Keras's ``validation_split``: the last ``fraction`` of the rows (before any shuffle)
    becomes ``validation_data``; arrays only, as in Keras."""
    import jax
    if not _is_arrays(x) or not 0.0 < fraction < 1.0:
        raise ValueError(f"model.fit under a strategy: validation_split={fraction!r} needs "
                         f"NumPy or JAX arrays and a fraction in (0, 1), as in Keras; pass "
                         f"validation_data otherwise")
    cut = int(math.floor(_rows(x) * (1.0 - fraction)))

    def part(tree, rows):
        return None if tree is None else jax.tree_util.tree_map(lambda a: np.asarray(a)[rows],
                                                                tree)
    kept = (part(x, slice(None, cut)), part(y, slice(None, cut)),
            part(sample_weight, slice(None, cut)))
    held = tuple(part(t, slice(cut, None)) for t in (x, y, sample_weight) if t is not None)
    return kept + (held,)


def loss_rule(model: Any, per_rank_data: bool = False, synchronized: bool = False) -> str:
    """How the replicas' gradients of ``model``'s compiled losses combine in ``fit``:
    ``"rows"`` when every loss is a mean (``sum_over_batch_size``, ``mean``, ...: each
    replica's gradient weighted by its rows, the gradient of the global batch's mean), or
    ``"replicas"`` when a loss has ``reduction="sum"`` (TensorFlow's rule: each replica's
    losses scaled as Keras's TensorFlow backend scales them, the gradients summed)::

        loss_rule(model)   # "replicas" after compile(loss=MeanSquaredError(reduction="sum"))

    Refused by name (``ValueError``): ``reduction="none"`` (a loss per row: Keras on JAX
    refuses it in one process too, its gradient needs a scalar), and ``"sum"`` with each
    rank's own data (``mpistrat.horovod``) or with ``SyncBatchNormalization``, whose numbers
    are not checked against TensorFlow's."""
    import jax
    import keras
    losses = jax.tree_util.tree_leaves(getattr(model, "loss", None),
                                       is_leaf=lambda v: isinstance(v, keras.losses.Loss))
    reductions = [(getattr(loss, "name", str(loss)), getattr(loss, "reduction", None))
                  for loss in losses if isinstance(loss, keras.losses.Loss)]
    for name, reduction in reductions:
        if reduction in (None, "none"):
            raise ValueError(
                f"model.fit under a strategy: the loss {name!r} has reduction={reduction!r} "
                f"(a value per row), which is not supported: Keras on JAX refuses it in one "
                f"process too (a gradient needs a scalar loss). Use reduction='sum' or the "
                f"default 'sum_over_batch_size'")
    summed = [name for name, reduction in reductions if reduction == "sum"]
    if not summed:
        return "rows"
    where = ("with each rank's own data (mpistrat.horovod)" if per_rank_data else
             "with SyncBatchNormalization" if synchronized else None)
    if where is not None:
        raise ValueError(
            f"model.fit {where}: the loss {summed[0]!r} has reduction='sum', which is not "
            f"supported there (its numbers are not checked against TensorFlow's); use the "
            f"default 'sum_over_batch_size', or write the step with "
            f"ms.nn.compute_average_loss")
    return "replicas"
