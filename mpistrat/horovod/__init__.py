"""Horovod's API on mpistrat, for programs written for ``horovod.tensorflow.keras``.

Change the import and the program runs under ``mpirun``/``srun`` on mpistrat, with Keras 3 on
JAX (no Horovod, no TensorFlow)::

    import keras
    import mpistrat.horovod as hvd             # was: import horovod.tensorflow.keras as hvd

    hvd.init()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]    # each rank its own rows
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=4, verbose=1 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(),
                         hvd.callbacks.LearningRateWarmupCallback(1e-3 * hvd.size(),
                                                                  warmup_epochs=2)])

What it does, Horovod's contract kept: each rank trains on the rows it is given, in batches of
``batch_size`` of its own; every step averages the gradients over the ranks (weighted by rows,
which is Horovod's plain average when the ranks' batches are equal) before the optimizer
applies them, so the weights stay the same on every rank; metrics are summed over the ranks
(the logs are global and the same everywhere, so ``MetricAverageCallback`` leaves them as they
are). Where Horovod hangs (ranks with different numbers of batches, from arrays or from
generators) every rank raises a ``ValueError`` naming each rank's count.

``allreduce`` gives Horovod's numbers: ``op`` is ``Average`` (the default), ``Sum``, ``Min``,
``Max`` or ``Product`` (``average=`` the old way, never with ``op=``); ``prescale_factor``
multiplies the input before the reduction and ``postscale_factor`` the result after it (as
Horovod's TensorFlow op: the factors are float32; integers scaled in float64 and truncated
toward zero, float16 in float32); ``Average`` is the sum times ``postscale / size`` under
the same rule; ``compression=Compression.fp16`` sends floating tensors as float16 and returns
the input's dtype. The ranks agree on the op, the factors, the compression and the ``name``
(in the validation probe the engine sends anyway): a rank that differs makes every rank
raise, naming each rank's. ``broadcast_object`` and ``allgather_object`` agree the root and
the name given in the exchange that carries the objects. Not supported, and refused by name
(``NotSupportedError``, both a ``NotImplementedError`` and a ``ValueError``): ``op=Adasum``,
process sets other than the global one, ``hvd.elastic`` (mpistrat's elastic jobs requeue
and resume: ``slurm/train_elastic.sbatch``); ``DistributedOptimizer`` takes ``op=Average``
or ``Sum`` only (as Horovod's Keras one), and ``model.fit`` refuses it with
``backward_passes_per_step`` other than 1 (custom loops honour it).

``DistributedOptimizer`` reduces the gradients wherever the optimizer is handed them: in
``fit``, and in custom loops (``apply_gradients``, ``apply``, ``stateless_apply``), with
Horovod's ``op``, ``gradient_predivide_factor``, ``compression`` and
``backward_passes_per_step`` (``optimizer.py``). Nothing is broadcast at compile:
``BroadcastGlobalVariablesCallback`` gives every rank its root's model and optimizer after
the first batch, as Horovod's.

Beside them: ``shutdown``/``is_initialized`` (after ``shutdown()`` calls raise
``NotInitializedError`` until ``init()`` again; MPI stays up), ``mpi_threads_supported``
(MPI's thread level), ``mpi_enabled``/``mpi_built``/``gloo_enabled``/``gloo_built``/
``nccl_built``, ``join`` (an agreement that every rank has finished: see its text for how it
differs), ``load_model`` (Keras's, the optimizer wrapped in ``DistributedOptimizer``) and the
callbacks in ``hvd.callbacks``, learning-rate schedule and warm-up included.
"""

import importlib
import operator
from typing import Any

import numpy as np

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_threads_supported", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "nccl_built", "join", "allreduce", "allgather",
           "broadcast", "broadcast_object", "allgather_object", "broadcast_variables",
           "DistributedOptimizer", "load_model", "Average", "Sum", "Min", "Max", "Adasum",
           "Product", "Compression", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "NotSupportedError", "NotInitializedError", "callbacks",
           "elastic"]

Average, Sum, Min, Max, Adasum, Product = "Average", "Sum", "Min", "Max", "Adasum", "Product"
_OPS = (Average, Sum, Min, Max, Product, Adasum)
_ENGINE_OP = {Average: "SUM", Sum: "SUM", Min: "MIN", Max: "MAX"}   # (Average: then scaled)


class NotSupportedError(NotImplementedError, ValueError):
    """What Horovod offers and ``mpistrat.horovod`` does not (``op=Adasum``, process sets
    other than the global one, ``hvd.elastic``): refused by name, on every rank that calls
    it."""


class NotInitializedError(ValueError):
    """A call that needs ``hvd.init()`` before it, or after ``hvd.shutdown()`` (a
    ``ValueError``, the class Horovod raises there, with Horovod's first sentence)."""


def _floating(dtype: np.dtype) -> bool:
    """Floating in TensorFlow's sense (what Horovod's fp16 compression casts)."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


class Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)`` before the
    reduction, ``decompress(tensor, ctx) -> tensor`` after it (NumPy arrays here)."""

    @staticmethod
    def compress(tensor: Any):
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is (Horovod's default)."""


class FP16Compressor(Compressor):
    """Floating tensors travel as float16; the result is cast back to the input's dtype
    (other tensors travel as they are)."""

    @staticmethod
    def compress(tensor: Any):
        value = np.asarray(tensor)
        return (value.astype(np.float16) if _floating(value.dtype) else value), value.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        value = np.asarray(tensor)
        return value.astype(ctx) if _floating(np.dtype(ctx)) else value


class Compression:
    """Horovod's compression choices: ``Compression.none`` (the default) and
    ``Compression.fp16``; a class of its own with ``compress``/``decompress`` works too."""
    none = NoneCompressor
    fp16 = FP16Compressor


def _compression_name(compression: Any) -> str:
    for name in ("none", "fp16"):
        if compression is getattr(Compression, name):
            return f"Compression.{name}"
    return getattr(compression, "__name__", None) or repr(compression)


class ProcessSet:
    """Horovod's process set. Only the global one (every rank, ``global_process_set``) is
    supported: collectives refuse any other with ``NotSupportedError``."""

    def __init__(self, ranks: Any = None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def size(self) -> int:
        return size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return rank() if self.ranks is None else self.ranks.index(rank())

    def included(self) -> bool:
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        return "global_process_set" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set: Any) -> Any:
    """Refused: only the global process set is supported."""
    raise NotSupportedError(f"hvd.add_process_set({process_set!r}): mpistrat.horovod runs "
                            f"every collective over every rank (global_process_set only)")


def remove_process_set(process_set: Any) -> bool:
    """Refused: only the global process set is supported."""
    raise NotSupportedError(f"hvd.remove_process_set({process_set!r}): mpistrat.horovod runs "
                            f"every collective over every rank (global_process_set only)")


_STATE: dict = {}


def init(comm: Any = None) -> None:
    """Start (collective): the world and a ``MultiWorkerMirroredStrategy`` over every rank.
    ``comm`` other than the whole world is not supported. A second ``init()`` does nothing
    (as Horovod's); after ``shutdown()`` it starts again."""
    if comm is not None:
        raise NotSupportedError("hvd.init(comm=...): mpistrat.horovod runs over every rank "
                                "of the job; call hvd.init()")
    if "strategy" not in _STATE:
        from mpistrat.distribute.mirrored import MultiWorkerMirroredStrategy
        _STATE["strategy"] = MultiWorkerMirroredStrategy()
        _STATE.pop("shut_down", None)


def shutdown() -> None:
    """Stop using Horovod's API on this rank (local, no collective): ``is_initialized()`` is
    then ``False``, and ``rank()``, ``size()``, the collectives and ``join()`` raise
    ``NotInitializedError`` until ``init()`` again. MPI is not finalized (it ends with the
    process, so ``init()`` may start again). A model compiled with ``DistributedOptimizer``
    before keeps the strategy it was given."""
    if "strategy" in _STATE:
        _STATE.clear()
        _STATE["shut_down"] = True


def is_initialized() -> bool:
    """Whether ``init()`` ran on this rank and no ``shutdown()`` came after it."""
    return "strategy" in _STATE


def _strategy():
    if "strategy" not in _STATE:
        after = " (hvd.shutdown() was called since; hvd.init() starts again)" \
            if _STATE.get("shut_down") else ""
        raise NotInitializedError(f"Horovod has not been initialized; use hvd.init().{after}")
    return _STATE["strategy"]


def _world():
    _strategy()
    from mpistrat.runtime import get_world
    return get_world()


def rank() -> int:
    """This process's rank among all (``hvd.rank()``)."""
    return _world().rank


def size() -> int:
    """The number of ranks (``hvd.size()``)."""
    return _world().size


def local_rank() -> int:
    """This rank's index on its node: pick a GPU with it."""
    return _world().local_rank


def local_size() -> int:
    """The number of ranks on this rank's node."""
    return _world().local_size


def cross_rank() -> int:
    """The index of this rank's node."""
    return _world().node_index


def cross_size() -> int:
    """The number of nodes."""
    return _world().num_nodes


def mpi_threads_supported() -> bool:
    """Whether MPI runs at ``MPI_THREAD_MULTIPLE`` (``MPI.Query_thread()``), so that other
    MPI code (``mpi4py``) may run beside the collectives on other threads. Needs ``init()``,
    as Horovod's."""
    _strategy()
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """``True``: MPI runs the job and its collectives (NCCL may carry device arrays)."""
    return True


def mpi_built() -> bool:
    """``True``: mpistrat runs over MPI (``mpi4py``)."""
    return True


def gloo_enabled() -> bool:
    """``False``: there is no Gloo controller; MPI carries everything."""
    return False


def gloo_built() -> bool:
    """``False``: mpistrat has no Gloo."""
    return False


def nccl_built() -> int:
    """NCCL's version code (``cupy.cuda.nccl.get_version()``, e.g. ``21803``) when the NCCL
    backend can be used for device arrays (CuPy with NCCL imports, ``MPISTRAT_NCCL`` is not
    0), else ``0``: Horovod's convention (the code of the NCCL it was built with, or 0)."""
    from mpistrat.runtime.devices import nccl_available
    if not nccl_available()[0]:
        return 0
    from cupy.cuda import nccl
    return int(nccl.get_version())


def _engine():
    return _strategy().extended.engine


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


def DistributedOptimizer(optimizer: Any, name: str = None, device_dense: str = "",  # noqa: N802
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """``optimizer`` (a Keras 3 optimizer) reducing over the ranks every gradient it is
    handed, by Horovod's rules; returns the same optimizer object::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        model.compile(optimizer=opt, loss="mse")    # fit: each rank its own rows
        opt.apply_gradients(zip(grads, model.trainable_variables))   # or a custom loop

    In ``model.fit`` the distributed train step reduces each step's gradients (the default
    average weighted by rows, Horovod's when the ranks' batches are equal); in a custom loop
    ``apply_gradients``/``apply`` reduce them on the host first, and ``stateless_apply`` in a
    host callback (inside ``jax.jit`` too). ``op``: ``Average`` (the default) or ``Sum``
    (Horovod's Keras optimizer takes no other); ``gradient_predivide_factor`` ``f``: the
    average as ``1/f`` before the sum and ``f/size`` after it; ``compression``: on the wire
    (``Compression.fp16``); ``backward_passes_per_step=N``: N calls summed on this rank (the
    weights unchanged, ``iterations`` counting each call), the N-th reduces the sum (divided
    by N with ``average_aggregated_gradients=True``) and applies it. ``model.fit`` refuses
    ``N > 1`` by name (its step applies every step), and so does ``stateless_apply``.
    ``device_dense``, ``device_sparse``, ``sparse_as_dense``, ``num_groups`` and ``groups``
    change how Horovod schedules its transfers, not the numbers: accepted and unused (JAX's
    gradients are dense). ``process_set``: the global one only. ``scale_local_gradients``:
    there are no local variables (``register_local_var`` is Horovod's), so it changes nothing.

    Given an optax ``GradientTransformation``, returns one that reduces the updates the same
    way (inside ``jax.jit`` too; ``backward_passes_per_step`` accumulated in its state)
    before the given one sees them::

        tx = hvd.DistributedOptimizer(optax.adam(1e-3))
        opt_state = tx.init(params)       # then tx.update(grads, opt_state, params) per step
    """
    what = "hvd.DistributedOptimizer"
    reduction = _gradient_reduction(what, name, compression, gradient_predivide_factor, op,
                                    backward_passes_per_step, average_aggregated_gradients,
                                    process_set)
    from mpistrat.horovod import optimizer as distributed
    if not hasattr(optimizer, "apply_gradients") and hasattr(optimizer, "update") and \
            hasattr(optimizer, "init"):                       # an optax transformation
        return distributed.optax_transformation(optimizer, reduction)
    if not hasattr(optimizer, "apply") or not hasattr(optimizer, "stateless_apply"):
        raise TypeError(f"{what}: {type(optimizer).__name__} is neither a Keras 3 optimizer "
                        f"nor an optax GradientTransformation")
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if reduction.passes > 1 and getattr(inner, "gradient_accumulation_steps", None):
        raise NotSupportedError(f"{what}: backward_passes_per_step={reduction.passes} with an "
                                f"optimizer that accumulates itself (gradient_accumulation_steps="
                                f"{inner.gradient_accumulation_steps}) would accumulate twice; "
                                f"give one of them")
    from mpistrat import keras_hooks
    keras_hooks.install()
    return distributed.distribute(optimizer, reduction)


def _gradient_reduction(what: str, name: Any = None, compression: Any = Compression.none,
                        gradient_predivide_factor: float = 1.0, op: Any = Average,
                        backward_passes_per_step: int = 1,
                        average_aggregated_gradients: bool = False,
                        process_set: Any = None) -> Any:
    """``DistributedOptimizer``'s options checked (on this rank alone: ``load_model`` may run
    on rank 0 only, as Horovod's resume examples do), as a ``GradientReduction``."""
    if op not in (Average, Sum):
        raise NotSupportedError(f"{what}: op={op!r} is not supported; Horovod's Keras "
                                f"DistributedOptimizer reduces gradients with op=hvd.Average "
                                f"or op=hvd.Sum only")
    if compression is None:
        compression = Compression.none
    if not (callable(getattr(compression, "compress", None)) and
            callable(getattr(compression, "decompress", None))):
        raise ValueError(f"{what}: compression={compression!r} is not a compressor "
                         f"(Compression.none, Compression.fp16, or a class with compress and "
                         f"decompress)")
    if isinstance(backward_passes_per_step, bool) or \
            not isinstance(backward_passes_per_step, (int, np.integer)) or \
            backward_passes_per_step <= 0:
        raise ValueError(f"{what}: backward_passes_per_step={backward_passes_per_step!r} must "
                         f"be an integer > 0")
    try:
        predivide = float(np.float32(float(gradient_predivide_factor)))
    except (TypeError, ValueError):
        raise TypeError(f"{what}: gradient_predivide_factor={gradient_predivide_factor!r} is "
                        f"not a number") from None
    if predivide == 0.0:
        raise ValueError(f"{what}: gradient_predivide_factor=0 divides by zero")
    if not (process_set is None or process_set is global_process_set or
            getattr(process_set, "process_set_id", None) == 0):
        raise NotSupportedError(f"{what}: process_set={process_set!r} is not supported; "
                                f"mpistrat.horovod reduces over every rank "
                                f"(global_process_set)")
    from mpistrat.horovod.optimizer import GradientReduction
    return GradientReduction(_strategy(), op, compression, predivide,
                             int(backward_passes_per_step), bool(average_aggregated_gradients),
                             name)


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """``keras.models.load_model(filepath)`` with the loaded model's optimizer wrapped in
    ``hvd.DistributedOptimizer`` (its state restored), ready to ``fit`` on every rank
    (Horovod's ``load_model``), from a ``.keras`` file or a legacy ``.h5`` one::

        model = hvd.load_model("model.keras")      # each rank then fits on its own rows

    ``custom_optimizers``: optimizer classes of your own the file names (found by their class
    names); ``custom_objects``: Keras's. Any optimizer the file holds is wrapped, Keras's own
    or yours. ``compression`` is ``DistributedOptimizer``'s; ``legacy_opts=True``
    (``tf.keras.optimizers.legacy``) is refused: Keras 3 has no legacy optimizers. A legacy
    ``.h5`` file's optimizer state (momentums, ...) is restored too (Keras 3 alone leaves it
    fresh). A model saved without compiling comes back as it is. Needs ``init()``; no
    collective, so Horovod's resume works as there: rank 0 loads, the other ranks build and
    compile afresh, and ``BroadcastGlobalVariablesCallback(0)`` gives every rank rank 0's
    model and optimizer after the first batch (or load on every rank, from a file every rank
    can read)."""
    what = "hvd.load_model"
    if legacy_opts:
        raise NotSupportedError(f"{what}(legacy_opts=True): Keras 3 has no legacy optimizers "
                                f"(tf.keras.optimizers.legacy); load with legacy_opts=False")
    _gradient_reduction(what, compression=compression)   # (refused before the file is read)
    strategy = _strategy()
    import keras
    objects = {cls.__name__: cls for cls in (custom_optimizers or ())}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(model, "compiled", True):
        return model
    if _is_h5(filepath):
        _restore_h5_optimizer(model, filepath)
    DistributedOptimizer(optimizer, compression=compression)
    from mpistrat.keras_support import distribute_model
    distribute_model(model, strategy, per_rank_data=True)   # (as compile would have)
    return model


def _is_h5(filepath: Any) -> bool:
    if type(filepath).__module__.startswith("h5py"):
        return True
    return str(filepath).endswith((".h5", ".hdf5"))


def _restore_h5_optimizer(model: Any, filepath: Any) -> None:
    """Keras 3 builds a legacy ``.h5`` file's optimizer on no variables and sets only its
    first weights (the iteration count, the rate): build it on the model's trainable
    variables and set every saved weight, as Keras 2 did. A state that does not fit warns
    and leaves the optimizer fresh, as Keras's loader does."""
    import warnings

    import h5py
    from mpistrat.keras_adapter import h5_optimizer_weights, rebuild_optimizer
    optimizer = model.optimizer
    try:
        opened = filepath if isinstance(filepath, (h5py.File, h5py.Group)) else \
            h5py.File(filepath, "r")
        try:
            saved = [np.asarray(value) for value in h5_optimizer_weights(opened)]
        finally:
            if opened is not filepath:
                opened.close()
    except (OSError, KeyError, ValueError) as err:
        warnings.warn(f"hvd.load_model: the optimizer state of {filepath!r} could not be read "
                      f"({type(err).__name__}: {err}); the optimizer starts fresh",
                      RuntimeWarning, stacklevel=3)
        return
    if not saved or len(saved) == len(optimizer.variables):
        return   # (nothing saved, or Keras restored it)
    if not hasattr(optimizer, "inner_optimizer"):   # (a LossScaleOptimizer: left to Keras)
        rebuild_optimizer(optimizer, model.trainable_variables)
    variables = optimizer.variables
    if len(saved) != len(variables) or any(tuple(v.shape) != s.shape
                                           for v, s in zip(variables, saved)):
        warnings.warn(f"hvd.load_model: the optimizer state of {filepath!r} ({len(saved)} "
                      f"weights) does not fit {type(optimizer).__name__} ({len(variables)} "
                      f"variables); the optimizer starts fresh", RuntimeWarning, stacklevel=3)
        return
    for variable, value in zip(variables, saved):
        variable.assign(value)


def __getattr__(name: str) -> Any:   # hvd.callbacks (with Keras) and hvd.elastic, when used
    if name in ("callbacks", "elastic"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mpistrat.horovod' has no attribute {name!r}")
