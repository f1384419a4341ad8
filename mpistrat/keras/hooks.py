"""Where mpistrat hooks into Keras's classes: ``compile`` and ``fit``, wrapped once.

``install()`` runs when a strategy is made or its scope entered with Keras already imported
(``on_scope``, registered with ``distribute.strategy.add_scope_hook``), or, when Keras is not
imported yet then, right after ``import keras`` runs (``on_scope`` puts a finder of ours on
``sys.meta_path`` that takes itself off at that import), so the guard below holds whichever
is imported first. Each wrapper replaces
the method on the Keras class that defines it (so ``keras.models.load_model``, which checks
that ``compile`` is Keras's own, still compiles the models it loads):

* ``compile`` inside ``strategy.scope()`` distributes the model
  (``trainer.distribute_model``), and so does a compile with an optimizer from
  ``mpistrat.horovod.DistributedOptimizer`` (each rank its own rows; such an optimizer
  reduces the gradients it is handed in custom loops itself: ``horovod/optimizer.py``);
* a Keras optimizer's ``apply_gradients`` inside ``strategy.run`` of several replicas sums
  the gradients over the replicas first, as TensorFlow's optimizers do in a replica context
  (the custom-loop tutorial scales its loss by the global batch, so the sum is the mean);
  ``skip_gradients_aggregation=True`` (or ``experimental_aggregate_gradients=False``)
  applies this replica's own, as there;
* a Keras metric made inside the scope of a strategy of several replicas is read as
  TensorFlow's (SyncOnRead, SUM) are: ``result()`` in cross-replica context sums its state
  over the replicas (collective: every rank reads it), inside ``strategy.run`` it is this
  replica's own; a distributed ``fit``/``evaluate`` already keeps global sums and reads them
  as they are;
* ``fit`` of a model that was not distributed is refused with a ``ValueError`` while a
  data-parallel strategy of several replicas exists: it would train a separate copy on every
  rank and average nothing, silently (a model compiled outside the scope, or before the
  strategy was made). ``train_alone(model)`` says that is meant::

      reference = ms.keras.train_alone(model)   # this rank alone, on purpose
      reference.fit(x, y)
"""

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

from mpistrat.keras.context import global_metrics, holds_global_sums, train_alone  # noqa: F401

__all__ = ["install", "on_scope", "refuse_undistributed_fit", "train_alone", "global_metrics"]

_INSTALLED = False
_INSTALLING = threading.Lock()
_LOCAL = threading.local()   # .reading: a metric's result() is being read (nested reads of
                             # its sub-metrics see the sums already)


def on_scope() -> None:
    """The scope hook: if Keras is already imported, ``install()``; else ``install()`` right
    after Keras is imported (Keras stays optional: nothing imports it here)."""
    if _INSTALLED:
        return
    if "keras" in sys.modules:
        install()
    elif not any(isinstance(f, _AfterKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """A finder that answers for the top-level ``keras`` module alone: it finds Keras's own
    spec as the import would have (the finders after it) and hands it back with a loader of
    ours that runs Keras's, then takes the finder off ``sys.meta_path`` and calls
    ``install()`` (so a model compiled outside every scope, with Keras imported after the
    strategy was made, is still refused by ``fit``). A probe (``importlib.util.find_spec``)
    that loads nothing leaves it armed; Keras's own loader is never changed (a zip's loader
    serves all of its modules)::

        strategy = ms.MultiWorkerMirroredStrategy()   # Keras not imported yet: armed
        import keras                                  # fit's guard installed here
    """

    def find_spec(self, name, path=None, target=None):
        if name != "keras" or getattr(_LOCAL, "finding", False):
            return None
        _LOCAL.finding = True
        try:
            spec = importlib.util.find_spec(name)   # (the finders after us answer)
        finally:
            _LOCAL.finding = False
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _InstallingLoader(spec.loader, self)
        return spec


class _InstallingLoader(importlib.abc.Loader):
    """Keras's loader, then ``install()``; everything else is Keras's loader's."""

    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        while self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        install()

    def __getattr__(self, name):
        return getattr(self._loader, name)


def install() -> None:
    """Wrap Keras's ``compile`` once so that a compile inside a scope distributes the model,
    and ``fit`` so that a model that was not distributed is refused while a strategy of
    several replicas exists (it would train a separate copy on every rank, silently).

    Called by ``on_scope`` when a strategy is made or its scope entered, when Keras is
    already imported. Each wrapper replaces the method on the Keras class that defines it,
    so ``keras.models.load_model`` still sees Keras's own ``compile`` and compiles.
    """
    if _INSTALLED:
        return
    import keras   # (outside the lock: Keras's import may call install() through our finder)
    with _INSTALLING:   # one thread wraps (a second would wrap the wrappers: sums twice)
        if not _INSTALLED:
            _wrap(keras)


def _wrap(keras) -> None:
    global _INSTALLED
    compiles = _defining_class(keras.Model, "compile")
    original = compiles.compile

    def compile(self, *args, **kwargs):  # noqa: A001 - Keras's own name
        result = original(self, *args, **kwargs)
        from mpistrat.distribute.context import get_strategy, has_strategy
        strategy = get_strategy() if has_strategy() else None
        # TPUStrategy (replicas inside compiled steps) is left to custom loops
        from mpistrat.keras.trainer import distribute_model
        if (strategy is not None and keras.backend.backend() == "jax"
                and not strategy.extended.replicas_in_compiled_steps):
            distribute_model(self, strategy)
        elif strategy is None and _horovod_strategy(self.optimizer) is not None:
            # hvd.DistributedOptimizer (maybe inside Keras's LossScaleOptimizer, which then
            # reduces at its own entry): each rank its own rows, gradients averaged
            from mpistrat.keras.steps import _horovod_reduction
            _horovod_reduction(self.optimizer).take_outer(self.optimizer)
            distribute_model(self, _horovod_strategy(self.optimizer), per_rank_data=True)
        return result

    compile.__doc__ = original.__doc__
    compiles.compile = compile
    fits = _defining_class(keras.Model, "fit")
    fits.fit = _guarded_fit(fits.fit)
    applies = _defining_class(keras.optimizers.Optimizer, "apply_gradients")
    applies.apply_gradients = _aggregating_apply(applies.apply_gradients)
    metrics = _defining_class(keras.metrics.Metric, "__init__")
    metrics.__init__ = _noting_init(metrics.__init__)
    results = keras.metrics.Metric
    for cls in set(_subclasses(results)) | {results}:
        if "result" in cls.__dict__:
            cls.result = _sync_on_read(cls.__dict__["result"])
    _INSTALLED = True


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _replicas_context():
    """The replica context of ``strategy.run`` under a strategy of several replicas, else
    ``None``."""
    from mpistrat.distribute.context import get_replica_context, in_cross_replica_context
    if in_cross_replica_context():
        return None
    context = get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return None
    return context


def _aggregating_apply(original):
    def apply_gradients(self, grads_and_vars, *args, skip_gradients_aggregation=False,
                        experimental_aggregate_gradients=True, **kwargs):
        context = _replicas_context()
        if context is not None and not skip_gradients_aggregation and \
                experimental_aggregate_gradients and _horovod_strategy(self) is None:
            pairs = list(grads_and_vars)
            present = [g for g, _ in pairs if g is not None]
            summed = iter(context.all_reduce("SUM", present) if present else [])
            grads_and_vars = [(None if g is None else next(summed), v) for g, v in pairs]
        return original(self, grads_and_vars, *args, **kwargs)

    apply_gradients.__doc__ = original.__doc__
    apply_gradients.__wrapped__ = original
    return apply_gradients


def _noting_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from mpistrat.distribute.context import get_strategy, has_strategy
        strategy = get_strategy() if has_strategy() else None
        if strategy is not None and strategy.num_replicas_in_sync > 1 and \
                not strategy.extended.replicas_in_compiled_steps:
            self._mpistrat_sync_on_read = strategy

    __init__.__doc__ = original.__doc__
    return __init__


def _sync_on_read(original):
    def result(self, *args, **kwargs):
        strategy = getattr(self, "_mpistrat_sync_on_read", None)
        if strategy is None or getattr(_LOCAL, "reading", False) or \
                holds_global_sums() or _replicas_context() is not None \
                or _in_stateless_scope():
            return original(self, *args, **kwargs)
        variables = list(self.variables)
        local = [v.value for v in variables]
        summed = strategy.extended.engine.all_reduce(
            [_host(x) for x in local], "SUM") if local else []
        _LOCAL.reading = True
        try:
            for variable, value in zip(variables, summed):
                variable.assign(value)
            return original(self, *args, **kwargs)
        finally:
            for variable, value in zip(variables, local):
                variable.assign(value)
            _LOCAL.reading = False

    result.__doc__ = original.__doc__
    result.__wrapped__ = original
    return result


def _host(value):
    import numpy as np
    return np.asarray(value)


def _in_stateless_scope() -> bool:
    from keras import backend
    probe = getattr(backend, "in_stateless_scope", None)
    if probe is None:
        from keras.src.backend.common.stateless_scope import in_stateless_scope as probe
    return bool(probe())


def _horovod_strategy(optimizer: Any) -> Any:
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        strategy = getattr(candidate, "_mpistrat_horovod", None)
        if strategy is not None:
            return strategy
    return None


def _defining_class(cls, name: str):
    return next(c for c in cls.__mro__ if name in c.__dict__)


def _guarded_fit(original):
    def fit(self, *args, **kwargs):
        refuse_undistributed_fit(self)
        return original(self, *args, **kwargs)

    fit.__doc__ = original.__doc__
    return fit


def refuse_undistributed_fit(model: Any) -> None:
    """Raise ``ValueError`` if ``model`` was compiled outside every strategy's scope while a
    data-parallel strategy of several replicas exists: ``fit`` would train a separate copy
    of the model on each rank and nothing would be averaged, silently."""
    if getattr(model, "_mpistrat_strategy", None) is not None or \
            getattr(model, "_mpistrat_alone", False):
        return
    from mpistrat.distribute.strategy import live_strategies
    several = [s for s in live_strategies() if s.num_replicas_in_sync > 1
               and not s.extended.replicas_in_compiled_steps]
    if several:
        strategy = several[-1]
        raise ValueError(
            f"{type(model).__name__} {model.name!r} was compiled outside strategy.scope() "
            f"while a {type(strategy).__name__} of {strategy.num_replicas_in_sync} replicas "
            f"exists: fit would train a separate copy on every rank and average nothing. "
            f"Compile it inside `with strategy.scope():` (build it there too, or call "
            f"ms.keras.distribute_model(model, strategy) after compiling; or, to "
            f"train on each rank alone on purpose, ms.keras.train_alone(model))")


def _register() -> None:
    from mpistrat.distribute.strategy import add_scope_hook
    add_scope_hook(on_scope)


_register()
