"""Horovod's collectives by Horovod's rules: ``allreduce`` (its ops, ``average``, pre- and
post-scale factors, compression), ``allgather``, ``broadcast``, ``broadcast_object``,
``allgather_object``, ``broadcast_variables`` and ``join``, each through the strategy's
engine. The ranks agree on what each call was given (the op, the factors, the compression,
the name; the ``*_object`` roots and names in the exchange that carries the objects), and a
refusal (Adasum, another process set, a bad argument) is agreed like a collective, so every
rank raises::

    loss = hvd.allreduce(loss, name="loss")                  # the average over the ranks
    total = hvd.allreduce(count, op=hvd.Sum)
    config = hvd.broadcast_object(config, root_rank=0)
"""

import operator
from typing import Any

import numpy as np

from mpistrat.horovod.compression import Compression, _compression_name, _floating
from mpistrat.horovod.world import NotSupportedError, _engine, global_process_set

Average, Sum, Min, Max, Adasum, Product = "Average", "Sum", "Min", "Max", "Adasum", "Product"
_OPS = (Average, Sum, Min, Max, Product, Adasum)
_ENGINE_OP = {Average: "SUM", Sum: "SUM", Min: "MIN", Max: "MAX"}   # (Average: then scaled)


def _refuse(error: type, text: str) -> None:
    """Raise ``error(text)``. With validation on (the default) the refusal is first agreed
    among the ranks like a collective of that name, so ranks that call the same way all
    raise it, and a rank refused while the others call a collective makes every rank raise,
    naming what each called, instead of leaving them waiting."""
    _engine().agree(f"refused: {text}", ())
    raise error(text)


def _check_process_set(what: str, process_set: Any) -> None:
    """Only the global process set (or ``None``): anything else is refused by name."""
    if process_set is None or process_set is global_process_set or \
            getattr(process_set, "process_set_id", None) == 0:
        return
    _refuse(NotSupportedError, f"{what}: process_set={process_set!r} is not supported; "
                               f"mpistrat.horovod runs every collective over every rank "
                               f"(global_process_set)")


def _reduction(what: str, op: Any, average: Any) -> str:
    """Horovod's op from ``op`` and the older ``average``: giving both is an error."""
    if isinstance(average, str):
        _refuse(TypeError, f"{what}: average={average!r} is text; pass the tensor's name as "
                           f"name=... (horovod.tensorflow.keras takes it second)")
    if op is not None and average is not None:
        _refuse(ValueError, f"{what}: op={op!r} and average={average!r}: op supersedes "
                            f"average, so give only one of them")
    if op is None:
        op = Sum if average is not None and not average else Average
    if op == Adasum:
        _refuse(NotSupportedError, f"{what}: op=Adasum is not supported by mpistrat.horovod "
                                   f"(Average, Sum, Min, Max and Product are)")
    if op not in _OPS:
        _refuse(ValueError, f"{what}: op={op!r} is not one of Horovod's reductions (Average, "
                            f"Sum, Min, Max, Product)")
    return op


def _factor(what: str, keyword: str, value: Any) -> float:
    """A scale factor as Horovod's TensorFlow op holds it: a float32."""
    try:
        return float(np.float32(float(value)))
    except (TypeError, ValueError):
        _refuse(TypeError, f"{what}: {keyword}={value!r} is not a number")


def _compressor(what: str, compression: Any) -> Any:
    if compression is None:
        return Compression.none
    if callable(getattr(compression, "compress", None)) and \
            callable(getattr(compression, "decompress", None)):
        return compression
    _refuse(ValueError, f"{what}: compression={compression!r} is not a compressor "
                        f"(Compression.none, Compression.fp16, or a class with compress and "
                        f"decompress)")


def _scale(value: np.ndarray, factor: float) -> np.ndarray:
    """``value`` times ``factor`` as Horovod scales a buffer: float64 (and complex128) in
    float64; float32 (and complex64) times the factor as a float32; narrower floats in float32,
    rounded back; integers in float64, truncated toward zero. Other dtypes are left for the
    collective to refuse (on every rank, after the ranks agreed on them)."""
    dtype = value.dtype
    if dtype.kind in "iub":
        return np.asarray(np.trunc(value * factor), np.float64).astype(dtype)
    if _floating(dtype) and dtype.itemsize < 4:
        return np.asarray(value.astype(np.float32) * np.float32(factor), np.float32).astype(dtype)
    if dtype in (np.float32, np.complex64):
        return np.asarray(value * np.float32(factor), dtype)
    if dtype.kind in "fc":
        return np.asarray(value * factor, dtype)
    return value


def _described(what: str, **fields: Any) -> str:
    """``what`` and the fields that are set (not None): the text the ranks agree on."""
    return " ".join([what] + [f"{key}={value!r}" if key == "name" else f"{key}={value}"
                              for key, value in fields.items() if value is not None])


def allreduce(tensor: Any, average: Any = None, name: str = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              compression: Any = Compression.none, process_set: Any = None) -> Any:
    """The reduction of ``tensor`` over the ranks (default: the average), on every rank, by
    Horovod's rules: ``op`` (``Average``, ``Sum``, ``Min``, ``Max``, ``Product``) or the older
    ``average`` (not both: ``ValueError``); the input times ``prescale_factor`` before, the
    result times ``postscale_factor`` after (``Average``: times ``postscale_factor / size``),
    each factor a float32, integers truncated toward zero; ``compression`` on the wire, the
    result in the input's dtype. The ranks agree on the op, the factors, the compression and
    ``name``: a rank that differs makes every rank raise, naming each rank's::

        loss = hvd.allreduce(loss, name="loss")                  # the average over the ranks
        grads = hvd.allreduce(g, op=hvd.Sum, compression=hvd.Compression.fp16)
    """
    what = "hvd.allreduce"
    _check_process_set(what, process_set)
    op = _reduction(what, op, average)
    pre = _factor(what, "prescale_factor", prescale_factor)
    post = _factor(what, "postscale_factor", postscale_factor)
    compression = _compressor(what, compression)
    engine = _engine()
    wire, context = compression.compress(np.asarray(tensor))
    wire = np.asarray(wire)
    label = _described(f"{what} op={op}", name=name,
                       prescale_factor=pre if pre != 1.0 else None,
                       postscale_factor=post if post != 1.0 else None,
                       compression=None if compression is Compression.none else
                       _compression_name(compression))
    if pre != 1.0:
        wire = _scale(wire, pre)
    if op == Product:   # every rank's tensor, multiplied in rank order (in its dtype)
        out = np.multiply.reduce(engine.all_gather(wire[None], 0, label=label), axis=0,
                                 dtype=wire.dtype)
    else:
        out = engine.all_reduce(wire, _ENGINE_OP[op], label=label)
    post = post / engine.size if op == Average else post   # Horovod's average: a postscale
    out = np.asarray(out)
    if post != 1.0:
        out = _scale(out, post)
    return np.asarray(compression.decompress(out, context))


def allgather(tensor: Any, name: str = None, process_set: Any = None) -> Any:
    """Every rank's ``tensor`` concatenated along the first axis, in rank order (first
    dimensions may differ between ranks). The ranks agree on ``name``."""
    _check_process_set("hvd.allgather", process_set)
    label = None if name is None else _described("hvd.allgather", name=name)
    return _engine().all_gather(np.asarray(tensor), 0, label=label)


def broadcast(tensor: Any, root_rank: int, name: str = None, process_set: Any = None) -> Any:
    """Rank ``root_rank``'s ``tensor`` on every rank. The ranks agree on the root and ``name``
    (ranks naming different roots raise, naming each rank's)."""
    _check_process_set("hvd.broadcast", process_set)
    label = None if name is None else _described("hvd.broadcast", name=name)
    return _engine().broadcast(np.asarray(tensor), root_rank, label=label)


def _differ(what: str, field: str, values: list) -> None:
    """Raise on every rank (each holds every rank's ``values``) unless they are all equal."""
    if any(repr(v) != repr(values[0]) for v in values[1:]):
        from mpistrat.errors import InvalidArgumentError
        raise InvalidArgumentError(f"{what}: ranks pass different {field}s: " + "; ".join(
            f"rank {rank_} has {field}={value!r}" for rank_, value in enumerate(values)))


def broadcast_object(obj: Any, root_rank: int = 0, name: str = None,
                     process_set: Any = None) -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank. The ranks agree on the root and
    on ``name`` (when given) in the same exchange (no extra collective): ranks that differ
    all raise, naming each rank's."""
    what = "hvd.broadcast_object"
    _check_process_set(what, process_set)
    from mpistrat.collectives.objects import allgather_object as gather
    engine = _engine()
    try:
        root = operator.index(root_rank)   # (a NumPy integer as the int it is)
    except TypeError:
        root = root_rank
    mine = obj if root == engine.rank else None   # (only the root's object travels)
    everyone = gather(engine, (root, name, mine), what)
    _differ(what, "root_rank", [root_ for root_, _, _ in everyone])
    _differ(what, "name", [name_ for _, name_, _ in everyone])
    if type(root) is not int or not 0 <= root < engine.size:
        from mpistrat.errors import InvalidArgumentError
        raise InvalidArgumentError(f"{what}: root_rank={root_rank!r} is not a rank (ranks are "
                                   f"0 to {engine.size - 1})")
    return obj if root == engine.rank else everyone[root][2]


def allgather_object(obj: Any, name: str = None, process_set: Any = None) -> list:
    """Every rank's picklable ``obj``, in rank order. The ranks agree on ``name`` (when
    given) in the same exchange."""
    what = "hvd.allgather_object"
    _check_process_set(what, process_set)
    from mpistrat.collectives.objects import allgather_object as gather
    everyone = gather(_engine(), (name, obj), what)
    _differ(what, "name", [name_ for name_, _ in everyone])
    return [value for _, value in everyone]


def broadcast_variables(variables: Any, root_rank: int, process_set: Any = None) -> None:
    """Assign rank ``root_rank``'s values to ``variables`` (Keras variables) on every rank
    (the ranks agree on the root)."""
    _check_process_set("hvd.broadcast_variables", process_set)
    variables = list(variables)
    values = _engine().broadcast([np.asarray(v.value if hasattr(v, "value") else v)
                                  for v in variables], root_rank, label="hvd.broadcast_variables")
    for variable, value in zip(variables, values):
        variable.assign(value)


def join() -> int:
    """Say that this rank has finished (collective): returns, on every rank, the rank Horovod
    reports as the last that joined.

    Horovod lets a rank that ran out of data join while the others go on reducing: it takes
    part in their all-reduces with zeros until every rank has joined. mpistrat.horovod does
    not: ``join()`` is an agreement that every rank has finished, valid only when no rank is
    still in a collective, so call it on every rank after its last one (with as many steps on
    every rank). It returns ``size() - 1``, what Horovod returns when the ranks' joins reach
    it together (it records the joins of one round in rank order and reports the last); when
    they come in different rounds Horovod's answer depends on timing. With validation on (the
    default), a rank that joins while another is in a collective makes every rank raise,
    naming what each called: ``NotSupportedError`` on the joining rank, ``InvalidArgumentError``
    on the others; with ``MPISTRAT_VALIDATE=0`` nothing checks it (as for any collective)::

        for batch in my_batches:          # the same number of batches on every rank
            loss = step(batch)
        last = hvd.join()                 # == hvd.size() - 1 on every rank
    """
    what = "hvd.join"
    engine = _engine()
    from mpistrat.errors import InvalidArgumentError
    try:
        last = engine.all_reduce(np.array([engine.rank], np.int64), "MAX", label=what)
    except InvalidArgumentError as err:
        raise NotSupportedError(
            f"{what} on rank {engine.rank} while other ranks are still in a collective "
            f"({err}). Horovod lets a rank that ran out of data join while the others go on "
            f"reducing, with zeros for it; mpistrat.horovod does not: give every rank the same "
            f"number of steps (steps_per_epoch no rank exceeds, or as many rows on each) and "
            f"call hvd.join() on every rank after its last collective") from err
    return int(np.asarray(last).reshape(-1)[0])
