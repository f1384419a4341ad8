"""A small deterministic fuzz of real TensorFlow indexes (tests/data/tf): every truncation,
byte flips everywhere, and flips inside each block with its CRC made right again (so the
parsing below the CRC is reached: varints, restart arrays, keys, entry protos, slice keys).

Each read ends in exactly the original entries, another consistent index (a flip the CRC
was recomputed for), or an error of TensorFlow's classes naming the file; never an
IndexError, struct.error, UnicodeDecodeError, MemoryError, RecursionError or a hang.
"""

import os
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from mpistrat.errors import DataLossError, InvalidArgumentError, NotFoundError
from mpistrat.tfformats import bundle, sstable
from mpistrat.tfformats.crc import masked_crc32c

DATA = Path(__file__).resolve().parents[1] / "data" / "tf"
NAMED = (DataLossError, InvalidArgumentError, NotFoundError)


def _summary(index):
    return {k: (e.enum, e.shape, e.file, e.offset, e.size, e.crc, e.refused, len(e.slices))
            for k, e in index.entries.items()}


def _outcome(prefix: str, original):
    """``"same"``, ``"other"`` or ``"named"``; anything else fails the test."""
    try:
        index = bundle.read_index(prefix)
    except NAMED as err:
        assert os.path.basename(prefix) in str(err), str(err)
        return "named"
    got = _summary(index)
    if got == original:
        return "same"
    for key, entry in index.entries.items():   # a consistent index: what it says reads or is named
        if got.get(key) != original.get(key):
            try:
                bundle.read_value(entry)
            except NAMED as err:
                assert os.path.basename(prefix) in str(err), str(err)
    return "other"


def _copy(name, tmp_path):
    source = DATA / name
    for path in source.parent.iterdir():
        if path.name.startswith(source.name + "."):
            shutil.copy(path, tmp_path / path.name)
    prefix = str(tmp_path / source.name)
    return prefix, open(prefix + ".index", "rb").read(), _summary(bundle.read_index(prefix))


@pytest.fixture
def copy(tmp_path):
    """A small real index (1,140 bytes: every dtype, strings, an empty tensor)."""
    return _copy("module/ckpt-1", tmp_path)


@pytest.fixture(params=["module/ckpt-1", "sliced/policy/ckpt"])
def either(request, tmp_path):
    """That index, and one of partitioned variables (slice keys, slice lists)."""
    return _copy(request.param, tmp_path)


def test_every_truncation_is_named(copy):
    prefix, data, original = copy
    for keep in range(len(data)):
        with open(prefix + ".index", "wb") as handle:
            handle.write(data[:keep])
        assert _outcome(prefix, original) == "named", keep


def test_byte_flips_anywhere_are_named_or_change_nothing(copy):
    prefix, data, original = copy
    rng = random.Random(7)
    seen = set()
    for position in range(len(data)):
        changed = bytearray(data)
        changed[position] ^= rng.choice([0x01, 0x04, 0x20, 0x80, 0xFF])
        with open(prefix + ".index", "wb") as handle:
            handle.write(changed)
        seen.add(_outcome(prefix, original))
    assert seen <= {"named", "same"} and "named" in seen   # every block is CRC-checked


def _blocks(data: bytes):
    """``(offset, size)`` of the index block and every data block."""
    footer = len(data) - sstable.FOOTER_BYTES
    _, pos = sstable._handle(data, footer, footer + 40, "f")
    index_handle, _ = sstable._handle(data, pos, footer + 40, "f")
    index = sstable._entries(bytes(data[index_handle[0]:sum(index_handle)]), "f", "index", None,
                             [1 << 30])
    return [index_handle] + [sstable._handle(v, 0, len(v), "f")[0] for _, v in index]


def test_flips_below_the_crc_are_named_or_read_consistently(either):
    prefix, data, original = either
    rng = random.Random(20261206)
    outcomes = []
    for offset, size in _blocks(data):
        for position in range(offset, offset + size):
            changed = bytearray(data)
            changed[position] ^= rng.choice([0x01, 0x02, 0x10, 0x80, 0xFF])
            crc = masked_crc32c(bytes(changed[offset:offset + size + 1]))
            changed[offset + size + 1:offset + size + 5] = struct.pack("<I", crc)
            with open(prefix + ".index", "wb") as handle:
                handle.write(changed)
            outcomes.append(_outcome(prefix, original))
    assert {"named", "other"} <= set(outcomes)
    assert np.mean([o == "named" for o in outcomes]) > 0.3
