"""Write tests/data/parse_oracle.json.gz: what TensorFlow 2.21 answers for every record and
spec below (the values, or the class of the error it raises), for
tests/unit/test_parse_oracle.py to hold ``ms.io`` to, bit for bit, without TensorFlow.

Needs TensorFlow, which mpistrat never does: run it from a separate environment,

    python3 -m venv /work/tfvenv && /work/tfvenv/bin/pip install tensorflow-cpu==2.21.0
    /work/tfvenv/bin/python tests/data/make_parse_oracle.py

The records (``tf.train.Example`` and ``tf.train.SequenceExample``, seeds fixed, so the file
is the same at every run):

* ``canonical``: what ``SerializeToString(deterministic=True)`` writes (keys sorted: the
  same bytes at every run), random features of every kind and length;
* ``crafted``: one record per encoding TensorFlow's fast parser reads its own way (valid
  protobuf it reads differently from protobuf, or refuses; protobuf's invalid data it reads):
  a list split into packed runs, packed then unpacked values, a feature given twice or
  empty, a Feature of two kinds, a packed float run of a length not a multiple of 4, lengths
  past their message's end or of 2^31 and more, unknown fields at every level, groups, map
  entries without key or value or value first, keys not UTF-8, varints of 10 and 11 bytes;
* ``structured``: random records that choose an encoding at every level of the message
  among those above;
* ``mutated``: records of the three kinds above with one to three bytes changed, inserted or
  deleted, or cut short.

Each record is parsed by ``tf.io.parse_single_example`` (``single``) and ``tf.io.parse_example``
of that record alone (``batch1``: a batch parses each record on its own, by rules a little
different from the single parser's) under every spec of ``EXAMPLE_SPECS`` (SequenceExamples:
``parse_single_sequence_example`` and ``parse_sequence_example`` under ``SEQUENCE_SPECS``).
``batches`` holds whole batches that TensorFlow parsed, of 1 to 300 records (some with one
record it refuses: the whole batch is refused), and the generator checks that each equals
the records' ``batch1`` answers stacked (FixedLen), joined (VarLen: row indices, the longest
row) or padded (FixedLenSequenceFeature), which is what lets the test check every batch size.

TensorFlow itself crashes on a few inputs (a bytes value claiming 2^31 bytes or more, a
FixedLenSequenceFeature of 0 values an item, a bytes value running past its list in a
SequenceExample's sparse features): each call runs in a worker process, and a call that kills
it is written as the error ``Crash`` (the test asks ``ms.io`` for an InvalidArgumentError
there).
"""

import gzip
import json
import os
import subprocess
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parse_oracle.json.gz")
SEED = 45

# name -> [kind, shape, dtype, default, allow_missing]; kind: fixed, var or seq
EXAMPLE_SPECS = {
    "mixed": {"f": ["fixed", [2], "float32", None, False],
              "i": ["fixed", [], "int64", -1, False],
              "s": ["fixed", [], "string", "dflt", False],
              "vf": ["var", None, "float32", None, False],
              "vi": ["var", None, "int64", None, False],
              "vs": ["var", None, "string", None, False]},
    "varlen": {"f": ["var", None, "float32", None, False],
               "i": ["var", None, "int64", None, False],
               "s": ["var", None, "string", None, False],
               "g": ["fixed", [2, 2], "int64", [[1, 2], [3, 4]], False],
               "vs": ["fixed", [1], "string", ["x"], False]},
    "sequence": {"f": ["seq", [2], "float32", 0.5, True],
                 "vi": ["seq", [], "int64", None, True],
                 "vs": ["seq", [], "string", None, True],
                 "g": ["seq", [2], "int64", None, True]},
    "required": {"f": ["fixed", [2], "float32", None, False],
                 "i": ["fixed", [], "int64", None, False],
                 "vf": ["fixed", [3], "float32", [0.0, 1.0, 2.0], False]},
    "edges": {"z0": ["fixed", [0], "float32", [], False],
              "z1": ["fixed", [0], "int64", None, False],
              "\u00e9": ["var", None, "float32", None, False],
              "a_long_key_name_over_8": ["var", None, "int64", None, False]},
    "broadcast_default": {"i": ["fixed", [2], "int64", 5, False]},
}
SEQUENCE_SPECS = {
    "all": ({"cf": ["fixed", [], "int64", 7, False], "cs": ["var", None, "string", None, False],
             "cv": ["fixed", [2], "float32", None, False]},
            {"sd": ["seq", [], "int64", None, True], "se": ["seq", [2], "float32", None, True],
             "ss": ["var", None, "string", None, False],
             "sv": ["var", None, "float32", None, False]}),
    "required": ({"cf": ["fixed", [], "int64", None, False],
                  "cs": ["fixed", [], "string", "none", False]},
                 {"sd": ["seq", [], "int64", None, False],
                  "sv": ["var", None, "float32", None, False]}),
    "context_var": ({"cf": ["var", None, "int64", None, False],
                     "cv": ["var", None, "float32", None, False],
                     "cs": ["var", None, "string", None, False]},
                    {"ss": ["seq", [], "string", None, True],
                     "si": ["var", None, "int64", None, False]}),
}


# --------------------------------------------------------------------------- wire format
def v(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def ld(field: int, payload: bytes) -> bytes:
    return v(field << 3 | 2) + v(len(payload)) + payload


def floats(values) -> bytes:
    return np.asarray(values, "<f4").tobytes()


HUGE = b"\x80\x80\x80\x80\x08"          # 2^31 as a varint
HUGER = b"\xff\xff\xff\xff\x0f"         # 2^32 - 1
UNKNOWN = [b"\x20\x05", b"\x29" + bytes(8), b"\x35" + bytes(4), b"\x3a\x02ab",
           b"\x20\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x00\x07"]


class Maker:
    """Encodings of each level of an Example, canonical or not, chosen by ``rng``."""

    def __init__(self, rng):
        self.rng = rng

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def values(self, kind: str, n: int):
        rng = self.rng
        if kind == "float":
            out = rng.standard_normal(n).astype(np.float32)
            if n and self.chance(0.3):
                out[int(rng.integers(n))] = self.pick([np.nan, -0.0, np.inf, -np.inf, 1e-45])
            return out
        if kind == "int64":
            edges = [0, -1, 1, 127, 128, 2 ** 63 - 1, -2 ** 63, 2 ** 35, -300]
            return [int(self.pick(edges)) if self.chance(0.5) else int(rng.integers(-999, 999))
                    for _ in range(n)]
        return [bytes(rng.integers(0, 256, int(rng.integers(0, 6)), dtype=np.uint8))
                for _ in range(n)]

    def list_body(self, kind: str, values, style: str) -> bytes:
        """A FloatList / Int64List / BytesList's fields."""
        if kind == "bytes":
            body = b"".join(ld(1, x) for x in values)
            if style == "unknown":
                body += self.pick(UNKNOWN)
            elif style == "overclaim" and values:
                body = b"".join(ld(1, x) for x in values[:-1]) + b"\x0a" + v(
                    len(values[-1]) + 3) + values[-1]
            return body
        if kind == "float":
            raw = floats(values)
            one = [b"\x0d" + raw[k:k + 4] for k in range(0, len(raw), 4)]
            packed = lambda r: ld(1, r)  # noqa: E731
        else:
            raw_items = [v(x) for x in values]
            if style == "padded_varints":
                raw_items = [v(x)[:-1] + bytes([v(x)[-1] | 0x80]) + b"\x00"
                             if len(v(x)) < 10 else v(x) for x in values]
            if style == "wide_varints":
                raw_items = [bytes([(x >> 7 * k) & 0x7F | 0x80 for k in range(9)]) + b"\x7f"
                             for x in values]
            raw = b"".join(raw_items)
            one = [b"\x08" + item for item in raw_items]
            packed = lambda r: ld(1, r)  # noqa: E731
        if not len(values) and style not in ("empty_packed", "unknown"):
            return b""
        cut = int(self.rng.integers(0, len(values) + 1)) if len(values) else 0
        cut_bytes = 4 * cut if kind == "float" else len(b"".join(raw_items[:cut]))
        if style in ("packed", "padded_varints", "wide_varints"):
            return packed(raw)
        if style == "unpacked":
            return b"".join(one)
        if style == "split":
            return packed(raw[:cut_bytes]) + packed(raw[cut_bytes:])
        if style == "packed_unpacked":
            return packed(raw[:cut_bytes]) + b"".join(one[cut:])
        if style == "unpacked_packed":
            return b"".join(one[:cut]) + packed(raw[cut_bytes:])
        if style == "ragged4":
            return packed(raw + bytes(int(self.rng.integers(1, 4))))
        if style == "empty_packed":
            return b"\x0a\x00" + packed(raw)
        if style == "unknown":
            return packed(raw) + self.pick(UNKNOWN)
        if style == "unknown_first":
            return self.pick(UNKNOWN) + packed(raw)
        if style == "packed_overclaim":
            return b"\x0a" + v(len(raw) + int(self.rng.integers(1, 9))) + raw
        if style == "packed_huge":
            return b"\x0a" + self.pick([HUGE, HUGER]) + raw
        if style == "cut_varint" and kind == "int64":
            return packed(raw + b"\x80")
        if style == "long_varint" and kind == "int64":
            return packed(raw + b"\xff" * 10 + b"\x01")
        return packed(raw)

    def feature(self, kind, values, list_style="packed", feature_style="one") -> bytes:
        """A Feature: its one list (or an other arrangement)."""
        field = {"bytes": 1, "float": 2, "int64": 3}[kind]
        body = self.list_body(kind, values, list_style)
        tag = bytes([field << 3 | 2])
        if feature_style == "overclaim":
            return tag + v(len(body) + int(self.rng.integers(1, 5))) + body
        if feature_style == "huge":
            return tag + self.pick([HUGE, HUGER]) + body
        if feature_style == "noncanonical_length":
            return tag + bytes([len(body) & 0x7F | 0x80]) + v(len(body) >> 7) + body \
                if len(body) < 1 << 14 else tag + v(len(body)) + body
        one = tag + v(len(body)) + body
        if feature_style == "two_kinds":
            other = self.pick([k for k in ("bytes", "float", "int64") if k != kind])
            return one + self.feature(other, self.values(other, 2))
        if feature_style == "trailing":
            return one + self.pick(UNKNOWN)
        if feature_style == "empty":
            return b""
        if feature_style == "bad_type":
            return self.pick([b"\x22", b"\x08", b"\x2a"]) + v(len(body)) + body
        if feature_style == "twice":
            return one + one
        return one

    def entry(self, key: bytes, feature: bytes, style="canonical") -> bytes:
        k, f = ld(1, key), ld(2, feature)
        body = {"canonical": k + f, "value_first": f + k, "key_only": k, "value_only": f,
                "key_twice": k + k, "value_twice": f + f, "extra": k + f + self.pick(UNKNOWN),
                "noncanonical_tags": b"\x8a\x00" + k[1:] + b"\x92\x00" + f[1:],
                "empty": b"", "three": k + f + f}[style]
        return ld(1, body)

    def features(self, entries, style="canonical") -> bytes:
        body = b"".join(entries)
        if style == "unknown_inside" and entries:
            at = int(self.rng.integers(len(entries) + 1))
            body = b"".join(entries[:at]) + self.pick(UNKNOWN) + b"".join(entries[at:])
        if style == "overclaim":
            return b"\x0a" + v(len(body) + int(self.rng.integers(1, 6))) + body
        return ld(1, body)


EXAMPLE_KEYS = {"f": ("float", 2), "i": ("int64", 1), "s": ("bytes", 1), "vf": ("float", None),
                "vi": ("int64", None), "vs": ("bytes", None), "g": ("int64", 4),
                "z0": ("float", 0), "z1": ("int64", 0), "\u00e9": ("float", None),
                "a_long_key_name_over_8": ("int64", None), "u": ("float", None)}
EXAMPLE_KEY_BYTES = {k: k.encode() for k in EXAMPLE_KEYS}
EXAMPLE_KEY_BYTES["\udcff"] = b"\xff"          # a key that is not UTF-8 (never asked for)
EXAMPLE_KEYS["\udcff"] = ("int64", None)


def random_items(maker: Maker, p_home=0.95):
    """(key bytes, kind, values) of a random Example, most keys of their usual kind and
    count (the fixed ones present most often)."""
    rng, items = maker.rng, []
    for key, (kind, count) in EXAMPLE_KEYS.items():
        if not maker.chance(0.92 if key in ("f", "i", "s", "z0", "z1") else 0.55):
            continue
        if not maker.chance(p_home):
            kind = maker.pick(["float", "int64", "bytes"])
        n = count if count is not None and maker.chance(0.95) else int(rng.integers(0, 7))
        items.append((EXAMPLE_KEY_BYTES[key], kind, maker.values(kind, n)))
    order = rng.permutation(len(items))
    return [items[i] for i in order]


def canonical_examples(tf, rng, count):
    maker, out = Maker(rng), []
    for _ in range(count):
        feature = {}
        for key, kind, values in random_items(maker):
            if maker.chance(0.05):
                feature[key.decode("utf-8", "surrogateescape")] = tf.train.Feature()
            elif kind == "float":
                feature[key.decode("utf-8", "surrogateescape")] = tf.train.Feature(
                    float_list=tf.train.FloatList(value=values))
            elif kind == "int64":
                feature[key.decode("utf-8", "surrogateescape")] = tf.train.Feature(
                    int64_list=tf.train.Int64List(value=values))
            else:
                feature[key.decode("utf-8", "surrogateescape")] = tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=values))
        feature.pop("\udcff", None)                 # (protobuf refuses to write it)
        out.append(tf.train.Example(features=tf.train.Features(feature=feature))
                   .SerializeToString(deterministic=True))
    return out


LIST_STYLES = {"float": ["unpacked", "split", "packed_unpacked", "unpacked_packed", "ragged4",
                         "empty_packed", "unknown", "unknown_first", "packed_overclaim",
                         "packed_huge"],
               "int64": ["unpacked", "split", "packed_unpacked", "unpacked_packed",
                         "empty_packed", "unknown", "unknown_first", "packed_overclaim",
                         "packed_huge", "padded_varints", "wide_varints", "cut_varint",
                         "long_varint"],
               "bytes": ["unknown", "overclaim"]}
FEATURE_STYLES = ["overclaim", "huge", "noncanonical_length", "two_kinds", "trailing", "empty",
                  "bad_type", "twice"]
ENTRY_STYLES = ["value_first", "key_only", "value_only", "key_twice", "value_twice", "extra",
                "noncanonical_tags", "empty", "three"]


def structured_example(maker: Maker, p=0.12) -> bytes:
    """A random Example, each level's encoding chosen among the unusual ones with
    probability ``p``."""
    entries = []
    for key, kind, values in random_items(maker):
        list_style = maker.pick(LIST_STYLES[kind]) if maker.chance(2 * p) else "packed"
        feature_style = maker.pick(FEATURE_STYLES) if maker.chance(p) else "one"
        feature = maker.feature(kind, values, list_style, feature_style)
        entries.append(maker.entry(key, feature, maker.pick(ENTRY_STYLES)
                                   if maker.chance(p / 2) else "canonical"))
        if maker.chance(p / 2):                     # the same key again
            kind2 = maker.pick(["float", "int64", "bytes"])
            entries.append(maker.entry(key, maker.feature(kind2, maker.values(kind2, 2))
                                       if maker.chance(0.8) else b""))
    parts = []
    while entries or not parts:
        take = len(entries) if not maker.chance(p) else int(maker.rng.integers(0, len(entries) + 1))
        parts.append(maker.features(entries[:take], maker.pick(["unknown_inside", "canonical",
                                                               "canonical"])
                                    if maker.chance(p / 2) else "canonical"))
        entries = entries[take:]
        if not entries:
            break
    record = b""
    for part in parts:
        if maker.chance(p):
            record += maker.pick(UNKNOWN + [b"\x0b", b"\x0c", b"\x3a" + HUGE])
        record += part
    if maker.chance(p):
        record += maker.pick([b"\x3a\x10ab", b"\x3a" + HUGE + b"xyz", b"\x8a\x00\x02\x0a\x00",
                              b"\x0a\x00", b"\x3b", b"\x3f", b"\x29\x01"])
    return record


def crafted_examples(maker: Maker):
    """One record per rule of TensorFlow's fast parser that differs from protobuf's."""
    f2 = floats([1.5, -2.0])
    pf = lambda raw: ld(2, ld(1, raw))                          # noqa: E731 (packed floats)
    pi = lambda raw: ld(3, ld(1, raw))                          # noqa: E731
    e = maker.entry
    ex = lambda *entries: maker.features(list(entries))         # noqa: E731
    cases = {
        "float split into two packed runs": ex(e(b"f", ld(2, ld(1, f2) + ld(1, floats([3]))))),
        "float packed then unpacked": ex(e(b"f", ld(2, ld(1, f2) + b"\x0d" + floats([3])))),
        "float unpacked then packed": ex(e(b"f", ld(2, b"\x0d" + floats([3]) + ld(1, f2)))),
        "float unpacked": ex(e(b"f", ld(2, b"\x0d" + floats([3]) + b"\x0d" + floats([4])))),
        "int64 split into two packed runs": ex(e(b"vi", ld(3, ld(1, b"\x01\x02") +
                                                     ld(1, b"\x03")))),
        "int64 packed then unpacked": ex(e(b"vi", ld(3, ld(1, b"\x01\x02") + b"\x08\x03"))),
        "int64 unpacked": ex(e(b"vi", ld(3, b"\x08\x01\x08\x7f"))),
        "a list field given twice (feature twice)": ex(e(b"vf", ld(2, ld(1, f2)) +
                                                         ld(2, ld(1, floats([9]))))),
        "a key given twice": ex(e(b"vi", pi(b"\x01")), e(b"vi", pi(b"\x02\x03"))),
        "a key given twice, the last empty": ex(e(b"vi", pi(b"\x01")), e(b"vi", b"")),
        "a key given twice, the first empty": ex(e(b"f", b""), e(b"f", pf(f2))),
        "a fixed key twice, the last empty": ex(e(b"f", pf(f2)), e(b"f", b"")),
        "a key twice, the first of the wrong type": ex(e(b"f", pi(b"\x01\x02")), e(b"f", pf(f2))),
        "a key twice, the last of the wrong type": ex(e(b"f", pf(f2)), e(b"f", pi(b"\x01\x02"))),
        "a key twice, the first of a bad type byte": ex(e(b"f", b"\x22\x00"), e(b"f", pf(f2))),
        "features given twice": ex(e(b"f", pf(f2))) + ex(e(b"vi", pi(b"\x05"))),
        "non-UTF-8 key unasked": ex(e(b"f", pf(f2)), e(b"\xff\xfe", pf(f2))),
        "non-UTF-8 key asked": ex(e(b"\xff", pi(b"\x05"))),
        "malformed unasked feature": ex(e(b"f", pf(f2)), e(b"u", b"\x1a\x01\x80")),
        "unasked feature of a bad type byte": ex(e(b"f", pf(f2)), e(b"u", b"\x22\x00")),
        "packed floats of 6 bytes": ex(e(b"vf", ld(2, ld(1, f2[:6])))),
        "packed floats of 9 bytes, fixed 2": ex(e(b"f", ld(2, ld(1, f2 + b"\x00")))),
        "list length past its Feature's end": ex(e(b"vf", b"\x12" + v(len(ld(1, f2)) + 5) +
                                                   ld(1, f2))),
        "packed length past its list's end": ex(e(b"vf", ld(2, b"\x0a\x0c" + f2))),
        "packed length 2^31": ex(e(b"vf", ld(2, b"\x0a" + HUGE + f2))),
        "packed length 2^31, fixed": ex(e(b"f", ld(2, b"\x0a" + HUGE + f2))),
        "int64 packed length 2^31": ex(e(b"vi", ld(3, b"\x0a" + HUGE + b"\x01\x02"))),
        "list length 2^31": ex(e(b"vf", b"\x12" + HUGE + ld(1, f2))),
        "list length 2^32-1": ex(e(b"vi", b"\x1a" + HUGER + ld(1, b"\x07"))),
        "an unknown field past the end": ex(e(b"f", pf(f2))) + b"\x3a\x10ab",
        "an unknown field of length 2^31": ex(e(b"f", pf(f2))) + b"\x3a" + HUGE + b"\x20\x01",
        "an unknown field of length 2^31, then features":
            b"\x3a" + HUGE + ex(e(b"f", pf(f2))),
        "a Feature of two kinds": ex(e(b"f", pf(f2) + pi(b"\x01"))),
        "a Feature of two kinds, the first wrong": ex(e(b"f", pi(b"\x01") + pf(f2))),
        "an unknown field inside Features": ld(1, e(b"f", pf(f2)) + b"\x10\x01"),
        "an unknown field inside a float list": ex(e(b"f", ld(2, ld(1, f2) + b"\x10\x01"))),
        "an unknown field first in a float list": ex(e(b"f", ld(2, b"\x10\x01" + ld(1, f2)))),
        "an unknown field inside a bytes list": ex(e(b"vs", ld(1, ld(1, b"ab") + b"\x10\x01"))),
        "an unknown field inside a map entry": ex(maker.entry(b"f", pf(f2), "extra")),
        "a map entry without value": ex(maker.entry(b"f", pf(f2), "key_only")),
        "a map entry without key": ex(maker.entry(b"vf", pf(f2), "value_only")),
        "a map entry, value before key": ex(maker.entry(b"f", pf(f2), "value_first")),
        "a map entry, key twice": ex(maker.entry(b"f", pf(f2), "key_twice")),
        "a map entry, value twice": ex(maker.entry(b"vf", pf(f2), "value_twice")),
        "a map entry, non-canonical tags": ex(maker.entry(b"f", pf(f2), "noncanonical_tags")),
        "an empty map entry": ex(maker.entry(b"f", pf(f2), "empty")),
        "a group at the top": b"\x0b\x0c" + ex(e(b"f", pf(f2))),
        "a group end at the top": ex(e(b"f", pf(f2))) + b"\x0c",
        "a group inside Features": ld(1, b"\x13\x14" + e(b"f", pf(f2))),
        "wire types 6 and 7": ex(e(b"f", pf(f2))) + b"\x0e",
        "features tag non-canonical": b"\x8a\x00" + ex(e(b"f", pf(f2)))[1:],
        "field number 0": b"\x00\x05" + ex(e(b"f", pf(f2))),
        "int64 varint of 10 bytes, high bits": ex(e(b"vi", pi(b"\xff" * 9 + b"\x7f"))),
        "int64 varint of 11 bytes": ex(e(b"vi", pi(b"\xff" * 10 + b"\x01"))),
        "int64 padded varint": ex(e(b"i", pi(b"\x85\x80\x00"))),
        "int64 packed, cut varint": ex(e(b"vi", pi(b"\x01\x80"))),
        "bytes value past its list": ex(e(b"vs", ld(1, b"\x0a\x09ab"))),
        "bytes value length 2^31": ex(e(b"vs", ld(1, b"\x0a" + HUGE + b"ab"))),
        "bytes value length 2^31, fixed": ex(e(b"s", ld(1, b"\x0a" + HUGE + b"ab"))),
        "fixed bytes, two values": ex(e(b"s", ld(1, ld(1, b"a") + ld(1, b"b")))),
        "empty Features": ex(),
        "empty record": b"",
        "only unknown fields": b"\x20\x01\x35" + bytes(4),
        "Features length past the end": b"\x0a" + v(len(e(b"f", pf(f2))) + 9) + e(b"f", pf(f2)),
        "an entry length past Features' end": ld(1, b"\x0a" + v(len(e(b"f", pf(f2))) + 3) +
                                                 e(b"f", pf(f2))[2:]),
        "fixed [2] int64 missing (broadcast default)": ex(e(b"q", pi(b"\x01"))),
        "empty Feature": ex(e(b"f", b""), e(b"vf", b""), e(b"i", b""), e(b"vs", b"")),
        "zero-length lists": ex(e(b"f", b"\x12\x00"), e(b"vf", b"\x12\x00"), e(b"z0", b"\x12\x00"),
                                e(b"z1", b"\x1a\x00"), e(b"vs", b"\x0a\x00")),
        "zero-length packed runs": ex(e(b"vf", b"\x12\x02\x0a\x00"), e(b"z0", b"\x12\x02\x0a\x00"),
                                      e(b"vi", b"\x1a\x02\x0a\x00")),
        "a type byte unknown for an asked feature": ex(e(b"vi", b"\x22\x02\x0a\x00")),
        "floats unpacked, cut": ex(e(b"vf", ld(2, b"\x0d" + floats([3]) + b"\x0d\x00"))),
        "a NaN payload": ex(e(b"f", pf(b"\x01\x00\xc0\x7f\xff\xff\xff\xff"))),
    }
    return cases


def canonical_sequences(tf, rng, count):
    maker, out = Maker(rng), []
    for _ in range(count):
        context = {}
        for key, kind in (("cf", "int64"), ("cs", "bytes"), ("cv", "float"), ("u", "float")):
            if maker.chance(0.92 if key != "u" else 0.5):
                if not maker.chance(0.97):
                    kind = maker.pick(["float", "int64", "bytes"])
                n = {"cf": 1, "cv": 2}.get(key, int(rng.integers(0, 4)))
                if maker.chance(0.04):
                    n = int(rng.integers(0, 4))
                context[key] = _tf_feature(tf, kind, maker.values(kind, n))
        lists = {}
        for key, kind, width in (("sd", "int64", 1), ("se", "float", 2), ("ss", "bytes", None),
                                 ("sv", "float", None), ("si", "int64", None),
                                 ("u", "bytes", None)):
            if maker.chance(0.85):
                steps = []
                for _ in range(int(rng.integers(0, 5))):
                    k = kind if maker.chance(0.98) else maker.pick(["float", "int64", "bytes"])
                    n = width if width and maker.chance(0.97) else int(rng.integers(0, 4))
                    steps.append(_tf_feature(tf, k, maker.values(k, n)) if maker.chance(0.98)
                                 else tf.train.Feature())
                lists[key] = tf.train.FeatureList(feature=steps)
        out.append(tf.train.SequenceExample(
            context=tf.train.Features(feature=context),
            feature_lists=tf.train.FeatureLists(feature_list=lists))
            .SerializeToString(deterministic=True))
    return out


def _tf_feature(tf, kind, values):
    if kind == "float":
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))
    if kind == "int64":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))


SEQUENCE_KEYS = {"sd": ("int64", 1), "se": ("float", 2), "ss": ("bytes", None),
                 "sv": ("float", None), "si": ("int64", None), "u": ("bytes", None)}
STEP_STYLES = ["empty", "two_bytes", "one_byte", "two_kinds", "trailing", "unpacked",
               "split", "ragged4", "overclaim", "unknown", "noncanonical_empty"]


def structured_sequence(maker: Maker, p=0.12) -> bytes:
    rng = maker.rng
    context = []
    for key, kind, values in random_items(maker):
        if key not in (b"f", b"i", b"s", b"vf", b"vi", b"vs") or not maker.chance(0.9):
            continue
        name = {b"f": b"cv", b"i": b"cf", b"s": b"cs", b"vf": b"cv", b"vi": b"cf",
                b"vs": b"cs"}[key]
        list_style = maker.pick(LIST_STYLES[kind]) if maker.chance(2 * p) else "packed"
        feature_style = maker.pick(FEATURE_STYLES) if maker.chance(p) else "one"
        context.append(maker.entry(name, maker.feature(kind, values, list_style, feature_style),
                                   maker.pick(ENTRY_STYLES) if maker.chance(p / 2)
                                   else "canonical"))
    lists = []
    for key, (kind, width) in SEQUENCE_KEYS.items():
        if not maker.chance(0.85):
            continue
        steps = []
        for _ in range(int(rng.integers(0, 5))):
            k = kind if maker.chance(0.96) else maker.pick(["float", "int64", "bytes"])
            n = width if width and maker.chance(0.95) else int(rng.integers(0, 4))
            values = maker.values(k, n)
            style = maker.pick(STEP_STYLES) if maker.chance(p * 1.5) else "one"
            tag = bytes([{"bytes": 1, "float": 2, "int64": 3}[k] << 3 | 2])
            if style == "empty":
                step = b""
            elif style == "two_bytes":
                step = tag + b"\x00"
            elif style == "one_byte":
                step = tag
            elif style == "noncanonical_empty":
                step = tag + b"\x80\x00"
            elif style in ("two_kinds", "trailing", "overclaim"):
                step = maker.feature(k, values, "packed", style)
            else:
                list_style = {"unpacked": "unpacked", "split": "split", "ragged4": "ragged4",
                              "unknown": "unknown"}.get(style, "packed")
                if k == "bytes" and list_style not in LIST_STYLES["bytes"]:
                    list_style = "packed"
                step = maker.feature(k, values, list_style)
            steps.append(ld(1, step))
        body = b"".join(steps)
        if maker.chance(p / 2):
            body += maker.pick(UNKNOWN)
        lists.append(maker.entry(key.encode(), body, maker.pick(ENTRY_STYLES)
                                 if maker.chance(p / 2) else "canonical"))
    record = b""
    if context or maker.chance(0.5):
        record += ld(1, b"".join(context)) if not maker.chance(p / 2) else \
            maker.features(context, "unknown_inside")
    if maker.chance(p):
        record += maker.pick(UNKNOWN + [b"\x0b", b"\x3a" + HUGE])
    if lists or maker.chance(0.5):
        if maker.chance(p / 2) and len(lists) > 1:
            record += ld(2, b"".join(lists[:1])) + ld(2, b"".join(lists[1:]))
        else:
            record += ld(2, b"".join(lists))
    if maker.chance(p / 2):
        record = record[len(record) // 2:] + record[:len(record) // 2]
    return record


def crafted_sequences(maker: Maker):
    e = maker.entry
    f2 = floats([1.5, -2.0])
    step_i = lambda *xs: ld(3, ld(1, b"".join(v(x) for x in xs)))  # noqa: E731
    step_f = lambda raw: ld(2, ld(1, raw))                           # noqa: E731
    steps = lambda *ss: b"".join(ld(1, s) for s in ss)               # noqa: E731
    ctx = lambda *entries: ld(1, b"".join(entries))                  # noqa: E731
    fl = lambda *entries: ld(2, b"".join(entries))                   # noqa: E731
    good_ctx = ctx(e(b"cf", step_i(3)), e(b"cv", step_f(f2)))
    return {
        "entry value before key (context)": ld(1, maker.entry(b"cf", step_i(3), "value_first")),
        "entry value before key (lists)": fl(maker.entry(b"sd", steps(step_i(1)), "value_first")),
        "entry key only": good_ctx + fl(maker.entry(b"sd", steps(step_i(1)), "key_only")),
        "entry with an unknown field": fl(maker.entry(b"sd", steps(step_i(1)), "extra")),
        "unknown field in context": ld(1, e(b"cf", step_i(3)) + b"\x10\x01"),
        "unknown field in a FeatureList": good_ctx + fl(e(b"sd", steps(step_i(1)) + b"\x10\x01")),
        "unknown field at the top": b"\x20\x01" + good_ctx + b"\x35" + bytes(4),
        "unknown field past the end": good_ctx + b"\x3a\x10ab",
        "group at the top": b"\x0b" + good_ctx,
        "context given twice": ctx(e(b"cf", step_i(3))) + ctx(e(b"cv", step_f(f2))),
        "context key twice": ctx(e(b"cf", step_i(3)), e(b"cf", step_i(4)), e(b"cv", step_f(f2))),
        "context key twice, the last empty": ctx(e(b"cf", step_i(3)), e(b"cf", b""),
                                                 e(b"cv", step_f(f2))),
        "context packed floats of 6 bytes": ctx(e(b"cf", step_i(3)),
                                                e(b"cv", step_f(f2[:6]))),
        "context floats split": ctx(e(b"cf", step_i(3)), e(b"cv", ld(2, ld(1, f2[:4]) +
                                                                    ld(1, f2[4:])))),
        "context Feature of two kinds": ctx(e(b"cf", step_i(3) + step_f(f2)),
                                            e(b"cv", step_f(f2))),
        "context empty Feature": ctx(e(b"cf", b""), e(b"cv", step_f(f2))),
        "context bytes value past its list": ctx(e(b"cs", ld(1, b"\x0a\x05ab"))),
        "steps of two kinds": good_ctx + fl(e(b"sd", steps(step_i(1) + step_f(f2), step_i(2)))),
        "a step of one byte": good_ctx + fl(e(b"sd", b"\x0a\x01\x1a")),
        "an empty step": good_ctx + fl(e(b"sv", steps(b"", step_f(f2)))),
        "an empty list step": good_ctx + fl(e(b"sv", steps(b"\x12\x00", step_f(f2)))),
        "an empty list step, dense": good_ctx + fl(e(b"sd", steps(b"\x1a\x00", step_i(1)))),
        "a step's list, then more": good_ctx + fl(e(b"sv", steps(b"\x12\x00\x0a\x00"))),
        "a step with packed floats of 6 bytes": good_ctx + fl(e(b"sv", steps(step_f(f2[:6])))),
        "a step floats split": good_ctx + fl(e(b"se", steps(ld(2, ld(1, f2[:4]) +
                                                              ld(1, f2[4:]))))),
        "a step of the wrong kind": good_ctx + fl(e(b"sd", steps(step_f(f2)))),
        "a list given twice": good_ctx + fl(e(b"sd", steps(step_i(1))),
                                            e(b"sd", steps(step_i(2), step_i(3)))),
        "feature lists given twice": good_ctx + fl(e(b"sd", steps(step_i(1)))) +
        fl(e(b"sv", steps(step_f(f2)))),
        "a bytes step past its list": good_ctx + fl(e(b"ss", steps(ld(1, b"\x0a\x05ab")))),
        "a bytes step length 2^31": good_ctx + fl(e(b"ss", steps(ld(1, b"\x0a" + HUGE)))),
        "steps of many values": good_ctx + fl(e(b"sv", steps(step_f(floats(range(7))),
                                                            step_f(b"")))),
        "a step length past the list": good_ctx + fl(e(b"sv", b"\x0a\x30" + step_f(f2))),
        "empty record": b"",
        "only context": good_ctx,
        "non-UTF-8 key": ctx(e(b"\xff", step_i(1))) + fl(e(b"\xfe", steps(step_i(1)))),
    }


def mutate(rng, record: bytes) -> bytes:
    data = bytearray(record)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(7))
        at = int(rng.integers(0, len(data) + 1))
        if op == 0 and at < len(data):
            data[at] ^= 1 << int(rng.integers(8))
        elif op == 1 and at < len(data):
            data[at] = int(rng.integers(256))
        elif op == 2:
            data[at:at] = bytes([int(rng.integers(256))])
        elif op == 3 and at < len(data):
            del data[at]
        elif op == 4:
            del data[at:]
        elif op == 5 and len(data):
            a = int(rng.integers(len(data)))
            b = min(len(data), a + int(rng.integers(1, 8)))
            data[b:b] = data[a:b]
        elif op == 6 and at + 1 < len(data):
            data[at], data[at + 1] = data[at + 1], data[at]
    return bytes(data)


# --------------------------------------------------------------------------- TensorFlow side
def worker() -> None:
    """Read jobs (JSON lines) from stdin, answer each with TensorFlow's outcome."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    specs = {}

    def feature(kind, shape, dtype, default, allow_missing):
        dtype = {"float32": tf.float32, "int64": tf.int64, "string": tf.string}[dtype]
        if kind == "fixed":
            return tf.io.FixedLenFeature(shape, dtype, default_value=default)
        if kind == "var":
            return tf.io.VarLenFeature(dtype)
        return tf.io.FixedLenSequenceFeature(shape, dtype, allow_missing=allow_missing,
                                             default_value=default)

    def spec(description):
        if description is None:
            return None
        return {name: feature(*args) for name, args in description.items()}

    def tensor(value):
        value = np.asarray(value.numpy(), dtype=object if value.dtype == tf.string else None)
        if value.dtype == object:
            return {"shape": list(value.shape), "strings": [bytes(x).hex()
                                                            for x in value.reshape(-1)]}
        return {"shape": list(value.shape), "dtype": value.dtype.name,
                "hex": np.ascontiguousarray(value).tobytes().hex()}

    def output(out):
        result = {}
        for name, value in out.items():
            if isinstance(value, tf.SparseTensor):
                result[name] = {"indices": value.indices.numpy().reshape(-1).tolist(),
                                "values": tensor(value.values),
                                "dense_shape": value.dense_shape.numpy().tolist()}
            else:
                result[name] = tensor(value)
        return result

    for line in sys.stdin:
        job = json.loads(line)
        records = [bytes.fromhex(r) for r in job["records"]]
        out = None
        try:
            if job["op"] in ("single", "batch"):
                features = specs.setdefault(job["spec"], spec(EXAMPLE_SPECS[job["spec"]]))
                out = tf.io.parse_single_example(records[0], features) if job["op"] == "single" \
                    else tf.io.parse_example(records, features)
            else:
                ctx, seq = SEQUENCE_SPECS[job["spec"]]
                ctx, seq = spec(ctx), spec(seq)
                out = tf.io.parse_single_sequence_example(records[0], ctx, seq) \
                    if job["op"] == "seq_single" else \
                    tf.io.parse_sequence_example(records, ctx, seq)
            answer = None
        except UnicodeDecodeError as err:
            # An InvalidArgumentError whose message quotes the record ("Could not parse
            # example input, value: '...'"): its bytes are not UTF-8, so TensorFlow's
            # conversion of the message to Python fails before the error is raised.
            assert b"example input" in err.object or b"protocol message" in err.object, err
            answer = {"error": "InvalidArgumentError", "tf_raised": "UnicodeDecodeError"}
        except Exception as err:  # noqa: BLE001 - TensorFlow's class is the answer
            answer = {"error": type(err).__name__}
        if answer is None:                  # (an error here is the generator's: not caught)
            if job["op"] in ("single", "batch"):
                answer = {"values": output(out)}
            else:
                answer = dict(zip(("context", "sequence", "lengths"), map(output, out)))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


class TensorFlow:
    """A worker process (restarted after a crash: that job's answer is ``Crash``)."""

    def __init__(self):
        self.process = None
        self.crashes = 0

    def ask(self, op: str, spec: str, records) -> dict:
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        job = {"op": op, "spec": spec, "records": [r.hex() for r in records]}
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.process.wait()
            self.process = None
            self.crashes += 1
            return {"error": "Crash"}
        return json.loads(line)

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait()


# --------------------------------------------------------------------------- batches
def plain(answer: dict) -> dict:
    """An answer without the note of the class TensorFlow's Python side showed instead."""
    return {k: v for k, v in answer.items() if k != "tf_raised"}


def compose_example(answers, spec) -> dict:
    """The batch answer for records whose ``batch1`` answers are ``answers``."""
    if any("error" in a for a in answers):
        return {"error": "InvalidArgumentError"}
    out = {}
    for name, (kind, shape, dtype, default, _) in spec.items():
        parts = [a["values"][name] for a in answers]
        if kind == "var":
            lengths = [p["values"]["shape"][0] for p in parts]
            indices = [x for b, n in enumerate(lengths) for j in range(n) for x in (b, j)]
            out[name] = {"indices": indices, "values": _join([p["values"] for p in parts]),
                         "dense_shape": [len(parts), max(lengths)]}
        elif kind == "fixed":
            out[name] = _join(parts, [len(parts)] + list(shape))
        else:
            rows = max(p["shape"][1] for p in parts)
            padded = [_pad(p, rows, default, dtype, 1) for p in parts]
            out[name] = _join(padded, [len(parts), rows] + list(shape))
    return {"values": out}


def _join(tensors, shape=None) -> dict:
    if shape is None:
        shape = [sum(t["shape"][0] for t in tensors)]
    if "strings" in tensors[0]:
        return {"shape": shape, "strings": [s for t in tensors for s in t["strings"]]}
    return {"shape": shape, "dtype": tensors[0]["dtype"],
            "hex": "".join(t["hex"] for t in tensors)}


def _pad(tensor, rows, default, dtype, axis) -> dict:
    """``tensor`` ([1, r] + shape, or [r] + shape for axis 0) padded to ``rows``."""
    shape = list(tensor["shape"])
    item = int(np.prod(shape[axis + 1:]))
    missing = (rows - shape[axis]) * item
    shape[axis] = rows
    if "strings" in tensor:
        pad = (default if default is not None else "").encode().hex()
        return {"shape": shape, "strings": tensor["strings"] + [pad] * missing}
    numpy = {"float32": "<f4", "int64": "<i8"}[dtype]
    pad = np.full(missing, default if default is not None else 0, numpy).tobytes().hex()
    return {"shape": shape, "dtype": tensor["dtype"], "hex": tensor["hex"] + pad}


def compose_sequence(answers, spec) -> dict:
    if any("error" in a for a in answers):
        return {"error": "InvalidArgumentError"}
    ctx, seq = spec
    context = compose_example([{"values": a["context"]} for a in answers],
                              {k: [a[0], a[1], a[2], a[3], a[4]] for k, a in (ctx or {}).items()})
    sequence, lengths = {}, {}
    for name, (kind, shape, dtype, _, _) in (seq or {}).items():
        parts = [a["sequence"][name] for a in answers]
        if kind == "var":
            indices, values = [], []
            for b, p in enumerate(parts):
                flat = p["indices"]
                indices += [x for k in range(0, len(flat), 3) for x in (b, flat[k + 1],
                                                                         flat[k + 2])]
                values.append(p["values"])
            out_shape = [len(parts), max(p["dense_shape"][1] for p in parts),
                         max(p["dense_shape"][2] for p in parts)]
            sequence[name] = {"indices": indices, "values": _join(values),
                              "dense_shape": out_shape}
        else:
            rows = max(p["shape"][1] for p in parts)
            sequence[name] = _join([_pad(p, rows, None, dtype, 1) for p in parts],
                                   [len(parts), rows] + list(shape))
            lengths[name] = _join([a["lengths"][name] for a in answers], [len(parts)])
    return {"context": context["values"], "sequence": sequence, "lengths": lengths}


def batch_plan(rng, answers, count: int, largest: int = 300):
    """``count`` batches (lists of record indices) of 1 to ``largest`` records TensorFlow
    accepts alone, every fourth with one record it refuses."""
    good = [i for i, a in enumerate(answers) if "error" not in a]
    bad = [i for i, a in enumerate(answers) if a.get("error") == "InvalidArgumentError"]
    sizes = [1, 2, 3, largest] + sorted(rng.integers(4, largest, max(count - 4, 0)).tolist())
    plan = []
    for k, size in enumerate(sizes):
        if not good:
            break
        start = int(rng.integers(len(good)))
        batch = [good[(start + j) % len(good)] for j in range(size)]
        if k % 4 == 3 and bad:
            batch[int(rng.integers(size))] = bad[int(rng.integers(len(bad)))]
        plan.append(batch)
    return plan


# --------------------------------------------------------------------------- main
def main() -> int:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    rng = np.random.default_rng(SEED)
    maker = Maker(rng)

    examples, origins = [], []

    def add(kind, record):
        examples.append(record)
        origins.append(kind)

    for record in canonical_examples(tf, rng, 320):
        add("canonical", record)
    for name, record in sorted(crafted_examples(maker).items()):
        add("crafted: " + name, record)
    for _ in range(520):
        add("structured", structured_example(maker))
    base = list(examples)
    for _ in range(520):
        add("mutated", mutate(rng, base[int(rng.integers(len(base)))]))

    sequences, sequence_origins = [], []
    for record in canonical_sequences(tf, rng, 160):
        sequences.append(record)
        sequence_origins.append("canonical")
    for name, record in sorted(crafted_sequences(maker).items()):
        sequences.append(record)
        sequence_origins.append("crafted: " + name)
    for _ in range(260):
        sequences.append(structured_sequence(maker))
        sequence_origins.append("structured")
    base = list(sequences)
    for _ in range(260):
        sequences.append(mutate(rng, base[int(rng.integers(len(base)))]))
        sequence_origins.append("mutated")

    tensorflow = TensorFlow()
    oracle = {"tensorflow": tf.__version__, "example_specs": EXAMPLE_SPECS,
              "sequence_specs": SEQUENCE_SPECS,
              "examples": [r.hex() for r in examples], "example_origins": origins,
              "sequences": [r.hex() for r in sequences], "sequence_origins": sequence_origins,
              "single": {}, "batch1": {}, "batches": {},
              "seq_single": {}, "seq_batch1": {}, "seq_batches": {}}
    for spec in EXAMPLE_SPECS:
        chosen = range(len(examples)) if spec != "broadcast_default" else range(0, 40)
        oracle["single"][spec] = [tensorflow.ask("single", spec, [examples[i]]) for i in chosen]
        oracle["batch1"][spec] = [tensorflow.ask("batch", spec, [examples[i]]) for i in chosen]
        plan = batch_plan(rng, oracle["batch1"][spec], 24 if spec != "broadcast_default" else 2)
        batches = []
        for batch in plan:
            answer = tensorflow.ask("batch", spec, [examples[i] for i in batch])
            composed = compose_example([oracle["batch1"][spec][i] for i in batch],
                                       EXAMPLE_SPECS[spec])
            assert plain(answer) == composed, (spec, batch, answer, composed)
            batches.append({"records": batch, "answer": answer})
        oracle["batches"][spec] = batches
        print(spec, "crashes so far:", tensorflow.crashes, flush=True)
    for spec in SEQUENCE_SPECS:
        oracle["seq_single"][spec] = [tensorflow.ask("seq_single", spec, [r]) for r in sequences]
        oracle["seq_batch1"][spec] = [tensorflow.ask("seq_batch", spec, [r]) for r in sequences]
        batches = []
        for batch in batch_plan(rng, oracle["seq_batch1"][spec], 16):
            answer = tensorflow.ask("seq_batch", spec, [sequences[i] for i in batch])
            composed = compose_sequence([oracle["seq_batch1"][spec][i] for i in batch],
                                        SEQUENCE_SPECS[spec])
            assert plain(answer) == composed, (spec, batch, answer, composed)
            batches.append({"records": batch, "answer": answer})
        oracle["seq_batches"][spec] = batches
        print(spec, "crashes so far:", tensorflow.crashes, flush=True)
    tensorflow.close()
    text = json.dumps(oracle, sort_keys=True, separators=(",", ":")).encode()
    with open(OUT, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                               filename="") as out:
        out.write(text)
    print(f"{OUT}: {os.path.getsize(OUT)} bytes, {len(examples)} Examples, "
          f"{len(sequences)} SequenceExamples, TensorFlow crashed {tensorflow.crashes} times")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        sys.exit(main())
