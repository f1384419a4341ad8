"""Scratch is lent by explicit lease and results are the caller's: no memory we hand out is
ever lent again while the caller holds it, whatever it does with it (views, JAX arrays,
buffers held by C code), and the default cap fits a laptop as well as a node."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mpistrat.collectives.buffer_pool import BufferPool, default_cap
from mpistrat.runtime import get_world


def address(array) -> int:
    return array.__array_interface__["data"][0]


def test_a_lease_is_taken_back_at_the_end_of_its_block_and_lent_again():
    pool = BufferPool(max_bytes=1 << 20)
    with pool.lease((256,), np.float32) as first:
        kept = address(first)
        with pool.lease((256,), np.float32) as second:   # lent while the first is out
            assert address(second) != kept
    with pool.lease((16, 16), np.float32) as again:
        assert address(again) in {kept, address(second)}
    assert pool.held_bytes == 2 * 1024


def test_a_lease_beyond_the_cap_is_not_kept_and_a_failed_block_drops_its_lease():
    """A collective that timed out may leave a receive posted into its scratch: that memory
    must never be lent again."""
    pool = BufferPool(max_bytes=1000)
    with pool.lease((2000,), np.uint8):
        pass
    assert pool.held_bytes == 0
    with pool.lease((100,), np.uint8) as kept:
        pass
    assert pool.held_bytes == 100
    with pytest.raises(RuntimeError):
        with pool.lease((100,), np.uint8) as failed:
            assert address(failed) == address(kept)
            raise RuntimeError("a collective that timed out")
    assert pool.held_bytes == 0
    with pool.lease((100,), np.uint8) as fresh:
        assert address(fresh) != address(failed)


def test_the_default_cap_is_a_32nd_of_memory_at_most_1_gib(monkeypatch):
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.delenv("MPISTRAT_BUFFER_POOL_BYTES", raising=False)
    assert default_cap() == min(1 << 30, memory // 32)
    monkeypatch.setenv("MPISTRAT_BUFFER_POOL_BYTES", "64MiB")
    assert default_cap() == 64 << 20


def test_results_stay_the_callers_through_many_later_calls():
    """Before, results were views of pooled memory, reused when CPython's reference count
    of their owner said nobody held them; now no later call can write into them."""
    from mpistrat.collectives import CollectiveEngine
    engine = CollectiveEngine(get_world().comm)
    big = [engine.all_reduce(np.full(50000, float(i)), "SUM") for i in range(4)]
    fused = engine.all_reduce([np.full(8, 3.0)] * 20, "SUM")
    views = [r[10:20] for r in big]                     # only views held, not the results
    del big
    for _ in range(20):
        engine.all_reduce(np.zeros(50000), "SUM")
        engine.all_reduce([np.zeros(8)] * 20, "SUM")
    assert [float(v[0]) for v in views] == [0.0, 1.0, 2.0, 3.0]
    assert all(float(r[0]) == 3.0 for r in fused)


def test_glibc_keeps_freed_memory_unless_the_user_tuned_it():
    code = ("from mpistrat.runtime.allocator import keep_freed_memory as k; "
            "print(k(64 << 20), k(64 << 20))")
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert ours.stdout.split() == ["True", "True"], ours.stderr[-500:]
    for name, value in (("MALLOC_TRIM_THRESHOLD_", "131072"),
                        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")):
        theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**os.environ, name: value}, timeout=120)
        assert theirs.stdout.split() == ["False", "False"], (name, theirs.stderr[-500:])
