"""Gradient sets of known models, as (shape, dtype) lists, for ``plan`` and the predictions.

* ``resnet50``: torchvision's ResNet-50, 161 float32 tensors, 25,557,032 values (the
  set benchmarks/collectives.py reduces);
* ``llama7b``: a 7-billion-parameter decoder (LLaMA-7B's shapes: 32 layers of width
  4096, MLP 11008, vocabulary 32000), 291 bfloat16 tensors, 6,738,415,616 values.

    >>> shapes = gradient_set("resnet50")
    >>> len(shapes), sum(count(s) for s, _ in shapes)
    (161, 25557032)
    >>> sum(count(s) for s, _ in gradient_set("llama7b"))
    6738415616
"""

from typing import List, Tuple

__all__ = ["MODELS", "gradient_set", "count"]

Shape = Tuple[int, ...]


def _resnet50() -> List[Tuple[Shape, str]]:
    shapes: List[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return [(s, "float32") for s in shapes]


def _llama7b() -> List[Tuple[Shape, str]]:
    width, hidden, vocab = 4096, 11008, 32000
    shapes: List[Shape] = [(vocab, width)]
    for _ in range(32):
        shapes += [(width, width)] * 4 + [(hidden, width), (hidden, width), (width, hidden)]
        shapes += [(width,), (width,)]
    shapes += [(width,), (vocab, width)]
    return [(s, "bfloat16") for s in shapes]


MODELS = {"resnet50": _resnet50, "llama7b": _llama7b}


def gradient_set(name: str) -> List[Tuple[Shape, str]]:
    """The (shape, dtype) of every gradient of model ``name``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]()


def count(shape: Shape) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
