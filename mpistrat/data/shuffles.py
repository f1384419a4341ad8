"""The shuffles: ``shuffle(buffer_size)`` (TensorFlow's buffer) and ``global_shuffle``.

Both draw their order from a key derived from their seed (or, unseeded, one the ranks agreed
on, else one this process drew) and, with ``reshuffle_each_iteration``, from the iteration's
path: a new order each epoch and each repetition, the same on every rank::

    >>> from mpistrat.data import Dataset
    >>> a = [int(x) for x in Dataset.range(8).shuffle(4, seed=1)]
    >>> sorted(a) == list(range(8)), a == [int(x) for x in Dataset.range(8).shuffle(4, seed=1)]
    (True, True)
"""

import secrets
from typing import Optional

from mpistrat.data import plans
from mpistrat.data.ops import INFINITE, Iteration, Unary
from mpistrat.data.permutation import IndexPermutation, ShuffleBuffer, buffer_shuffle_order, \
    derive_key

__all__ = ["Random", "Shuffle", "GlobalShuffle", "STORED_ORDER_LIMIT"]

# shuffle(buffer) over a random-access input stores its order per epoch: up to this many
# elements (8 bytes each); longer inputs are shuffled element by element through the buffer
STORED_ORDER_LIMIT = 1 << 25


class Random(Unary):
    def __init__(self, input_, seed: Optional[int], reshuffle: bool):
        super().__init__(input_)
        self.seed = None if seed is None else int(seed)
        self.reshuffle = bool(reshuffle)
        self.fallback_seed = secrets.randbits(63)  # unseeded: each process draws its own
        # (a distributed dataset replaces it with one the ranks agree on)

    def key(self, it: Iteration, salt: int) -> int:
        return derive_key(it.seed_for(self), ((salt,) + it.path) if self.reshuffle else (salt,))


class Shuffle(Random):
    """``shuffle(buffer_size)``: TensorFlow's buffer; over a random-access input the same
    choices are made on indices (``buffer_shuffle_order``), so the result stays seekable."""

    name = "shuffle"

    def __init__(self, input_, buffer_size: int, seed, reshuffle):
        super().__init__(input_, seed, reshuffle)
        if int(buffer_size) < 1:
            raise ValueError(f"buffer_size must be positive, got {buffer_size}")
        self.buffer_size = int(buffer_size)

    def blocker(self):
        reason = self.input.blocker()
        if reason:
            return reason
        n = self.input.cardinality()
        if n < 0 or n > STORED_ORDER_LIMIT:
            return (f"shuffle(buffer_size) over {'an infinite' if n == INFINITE else 'a long'} "
                    f"input (its order is not stored beyond {STORED_ORDER_LIMIT} elements)")
        return None

    def plan(self, it):
        child = self.input.plan(it)
        order = buffer_shuffle_order(child.length, self.buffer_size, self.key(it, 0))
        return plans.Remap(child, child.length, lambda p: order[p])

    def sequential(self, it):
        return ShuffleBuffer(self.buffer_size, self.key(it, 0)).shuffle(self.input.elements(it))


class GlobalShuffle(Random):
    """``global_shuffle``: a keyed permutation of the input's indices (``IndexPermutation``)."""

    name = "global_shuffle"

    def plan(self, it):
        child = self.input.plan(it)
        permutation = IndexPermutation(child.length, self.key(it, 1))
        return plans.Remap(child, child.length, permutation)

    def sequential(self, it):  # pragma: no cover - construction requires random access
        raise ValueError("global_shuffle needs random access to its input")
