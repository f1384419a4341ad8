"""The pieces of ``jobs/train.py`` that are not distribution: data, model, optimizer.

* ``prepare(directory)``: scikit-learn's bundled handwritten digits (1797 images of 8x8
  pixels, shipped with the package: nothing is downloaded), split 80/20 (stratified,
  seeded) and written once as ``train.npy`` and ``test.npy``: float32 rows of 64 pixel
  values in [0, 1] followed by the label. Your own data in that layout works as well
  (any number of feature columns; labels 0..K-1 in the last column).
* ``init_params``: a two-layer perceptron (He initialisation, seeded).
* ``grad_sums``: JAX's ``jax.grad`` of the *summed* cross-entropy over a batch, plus the
  summed loss and the count of correct predictions; summing (not averaging) per replica
  lets the caller divide by the global row count, so any split of a batch over replicas
  gives the same update.
* ``per_example_grads``: the gradient of each example of a micro-batch on its own
  (``jax.lax.map`` of one example's gradient), for ``--deterministic``: every example
  runs the same compiled program wherever it lands, so the exact sum of them all does
  not depend on how the batch was split.
* ``adam_update``: Adam, written plainly as a pure function over pytrees.
"""

import os
from typing import Dict, Tuple

import numpy as np

TRAIN, TEST = "train.npy", "test.npy"


def prepare(directory: str, seed: int = 0) -> bool:
    """Write ``train.npy``/``test.npy`` under ``directory`` unless both exist; True if written.

    A directory holding only one of the two is an error (nothing is overwritten).

    Files are written under temporary names and renamed, so a reader never sees half a file.
    """
    present = [os.path.exists(os.path.join(directory, name)) for name in (TRAIN, TEST)]
    if all(present):
        return False
    if any(present):  # never overwrite half of someone's data
        have, missing = (TRAIN, TEST) if present[0] else (TEST, TRAIN)
        raise FileNotFoundError(f"{directory} has {have} but no {missing}: give both, or a "
                                f"directory with neither to get scikit-learn's digits")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=digits.target)
    os.makedirs(directory, exist_ok=True)
    for name, features, labels in ((TRAIN, x_train, y_train), (TEST, x_test, y_test)):
        rows = np.concatenate([features, labels[:, None]], axis=1)
        temporary = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
        with open(temporary, "wb") as handle:
            np.save(handle, rows)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, os.path.join(directory, name))
    return True


def describe(path: str) -> Tuple[int, int, int]:
    """``(rows, features, classes)`` of a prepared file (read through a memory map)."""
    rows = np.load(path, mmap_mode="r")
    if rows.ndim != 2 or rows.shape[1] < 2 or rows.dtype != np.float32:
        raise ValueError(f"{path}: expected float32 rows of features followed by a label, got "
                         f"shape {rows.shape} and dtype {rows.dtype}")
    labels = np.asarray(rows[:, -1])
    if labels.size and (np.any(labels < 0) or np.any(labels != np.round(labels))):
        raise ValueError(f"{path}: the last column must hold labels 0..K-1")
    return rows.shape[0], rows.shape[1] - 1, int(labels.max()) + 1 if labels.size else 0


def init_params(features: int, hidden: int, classes: int, seed: int) -> Dict[str, Dict]:
    """NumPy weights of a ``features -> hidden (ReLU) -> classes`` perceptron."""
    rng = np.random.default_rng(seed)

    def dense(fan_in, fan_out):
        return {"kernel": (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in))
                .astype(np.float32), "bias": np.zeros(fan_out, np.float32)}

    return {"hidden": dense(features, hidden), "output": dense(hidden, classes)}


def _split(batch):
    import jax.numpy as jnp
    return batch[:, :-1], batch[:, -1].astype(jnp.int32)


def _loss_and_stats(params, batch):
    import jax
    import jax.numpy as jnp
    x, y = _split(batch)
    h = jax.nn.relu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    logits = h @ params["output"]["kernel"] + params["output"]["bias"]
    log_p = jax.nn.log_softmax(logits)
    losses = -jnp.take_along_axis(log_p, y[:, None], axis=1)[:, 0]
    correct = jnp.sum(jnp.argmax(logits, axis=1) == y)
    return jnp.sum(losses), (jnp.sum(losses), correct.astype(jnp.float32))


def grad_sums(params, batch):
    """``(gradients of the summed loss, [loss sum, correct, rows])`` for one batch."""
    import jax
    import jax.numpy as jnp
    grads, (loss, correct) = jax.grad(_loss_and_stats, has_aux=True)(params, batch)
    return grads, jnp.stack([loss, correct, jnp.float32(batch.shape[0])])


def per_example_grads(params, rows):
    """``(gradients, [loss, correct, 1])`` of every row of ``rows``, each row alone: one
    example's gradient mapped over the rows (a loop in the compiled program, not a batched
    matrix product whose rounding could depend on the row's position)."""
    import jax
    return jax.lax.map(lambda row: grad_sums(params, row[None, :]), rows)


def eval_sums(params, batch):
    """``[loss sum, correct, rows]`` of one batch, without gradients."""
    import jax.numpy as jnp
    _, (loss, correct) = _loss_and_stats(params, batch)
    return jnp.stack([loss, correct, jnp.float32(batch.shape[0])])


def adam_update(params, grads, m, v, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step: ``(params, m, v)`` after ``grads`` at step ``step`` (1-based)."""
    import jax
    import jax.numpy as jnp
    m = jax.tree_util.tree_map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    params = jax.tree_util.tree_map(lambda p, m_, v_: p - scale * m_ / (jnp.sqrt(v_) + eps),
                                    params, m, v)
    return params, m, v
