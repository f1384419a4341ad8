"""Seeded orders over record indices, computed without the records. Pure functions.

* ``IndexPermutation(n, key)``: a keyed bijection of ``[0, n)`` (a Feistel
  network over the smallest even number of bits that covers ``n``, with
  cycle-walking back into range). Any position maps to its index in O(1), so
  ``global_shuffle`` never materialises the order and a resumed iterator
  seeks straight to its position.
* ``buffer_shuffle_order(n, buffer_size, key)``: the order in which a
  shuffle buffer of ``buffer_size`` emits ``n`` inputs (TensorFlow's rule:
  fill the buffer, then emit a uniformly chosen slot and refill it with the
  next input; emit what remains in random order at the end). Its random
  choices are a counter-based hash of the step (``buffer_slot``), so a buffer
  of elements (``ShuffleBuffer``) and this index form make the same choices.
* ``derive_key(seed, path)``: one 64-bit key per (seed, iteration path).

    >>> from mpistrat.data.permutation import IndexPermutation, buffer_shuffle_order
    >>> import numpy as np
    >>> p = IndexPermutation(10, key=7)
    >>> sorted(p(np.arange(10)).tolist()) == list(range(10))
    True
    >>> sorted(buffer_shuffle_order(10, 4, key=7).tolist()) == list(range(10))
    True
"""

import hashlib
import struct
from typing import Iterable, Iterator, List

import numpy as np

__all__ = ["derive_key", "IndexPermutation", "buffer_slot", "buffer_shuffle_order",
           "ShuffleBuffer"]

_MASK64 = (1 << 64) - 1
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_ROUNDS = 6


def derive_key(seed: int, path: Iterable[int] = ()) -> int:
    """A 64-bit key from ``seed`` and an iteration path (epoch, repetition, ...)."""
    words = [int(seed) & _MASK64] + [int(p) & _MASK64 for p in path]
    digest = hashlib.blake2b(struct.pack(f"<{len(words)}Q", *words), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): every output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class IndexPermutation:
    """A keyed pseudo-random bijection of ``[0, n)``: ``perm(positions) -> indices``."""

    def __init__(self, n: int, key: int):
        if n < 0:
            raise ValueError(f"a permutation needs n >= 0, got {n}")
        self.n = int(n)
        bits = max(2, int(self.n - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)           # domain 2^(2*half) < 4n
        self._low = np.uint64((1 << int(self._half)) - 1)
        self._keys = [np.uint64(derive_key(key, (round_,))) for round_ in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._low
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._low)
        return (left << self._half) | right

    def __call__(self, positions) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        out = self._encrypt(positions.reshape(-1).astype(np.uint64))
        n = np.uint64(self.n)
        outside = np.flatnonzero(out >= n)
        while outside.size:   # cycle-walking: values beyond n go round until they land inside
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= n]
        return out.astype(np.int64).reshape(positions.shape)


def buffer_slot(key: int, step, buffer_size: int):
    """The buffer slot emitted at ``step`` (an int or an array of steps)."""
    steps = np.atleast_1d(np.asarray(step, dtype=np.int64)).astype(np.uint64)
    slots = (_mix(steps ^ np.uint64(key)) % np.uint64(buffer_size)).astype(np.int64)
    return int(slots[0]) if np.ndim(step) == 0 else slots


def _drain_key(key: int) -> int:
    return derive_key(key, (1,))


def buffer_shuffle_order(n: int, buffer_size: int, key: int) -> np.ndarray:
    """Input index emitted at each output position by a shuffle buffer (vectorised).

    Step ``k`` of the steady phase emits slot ``j_k`` and refills it with input
    ``B + k``; slot ``j_k`` then holds the input written by the latest earlier
    step that chose it, or its first fill. Sorting steps by slot finds those.
    """
    size = min(int(buffer_size), n)
    if size <= 1:
        return np.arange(n, dtype=np.int64)
    steady = n - size
    slots = buffer_slot(key, np.arange(steady, dtype=np.int64), size)
    by_slot = np.argsort(slots, kind="stable")          # steps grouped by slot, in time order
    sorted_slots = slots[by_slot]
    follows = np.zeros(steady, dtype=bool)
    follows[1:] = sorted_slots[1:] == sorted_slots[:-1]  # an earlier step chose this slot
    previous = np.empty(steady, dtype=np.int64)
    previous[1:] = by_slot[:-1]
    out = np.empty(n, dtype=np.int64)
    out[by_slot] = np.where(follows, size + previous, sorted_slots)
    final = np.arange(size, dtype=np.int64)              # what the buffer holds at the end
    last = np.ones(steady, dtype=bool)
    last[:-1] = sorted_slots[1:] != sorted_slots[:-1]
    final[sorted_slots[last]] = size + by_slot[last]
    out[steady:] = final[IndexPermutation(size, _drain_key(key))(np.arange(size))]
    return out


class ShuffleBuffer:
    """The same buffer over elements (for inputs without random access)."""

    def __init__(self, buffer_size: int, key: int):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be positive, got {buffer_size}")
        self.size, self.key = int(buffer_size), key

    def shuffle(self, elements: Iterable) -> Iterator:
        buffer: List = []
        step = 0
        for element in elements:
            if len(buffer) < self.size:
                buffer.append(element)
                continue
            slot = buffer_slot(self.key, step, self.size)
            step += 1
            yield buffer[slot]
            buffer[slot] = element
        if len(buffer) <= 1:
            yield from buffer
            return
        order = IndexPermutation(len(buffer), _drain_key(self.key))(np.arange(len(buffer)))
        for position in order.tolist():
            yield buffer[position]
