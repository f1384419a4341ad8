"""Keras 3 and Flax NNX objects in a checkpoint's object graph: their variables, by name.

A framework object is walked through its variables only (its configuration, such as a
layer's ``units`` or ``built``, is code's business, not state), under paths that do not
depend on the automatic names a process happens to give (``dense_3``):

- **Keras 3** layers and models: own variables by name (``kernel``, ``moving_mean``),
  sublayers by the attribute that holds them (a subclassed model's ``self.encoder``) or
  else by position among the layers that are not input layers (``layer-0``: the same
  whether a Sequential got an ``Input`` or was built at its first call); seed generators as ``seed_generator-N/state``. Optimizers:
  ``iterations``, ``learning_rate``, then each slot list by name, one entry per trainable
  variable in build order (``momentums/0``, ``velocities/0``), and any other variable as
  ``variables/N``. Metrics: their variables by name (``total``, ``count``). A model
  trained by ``fit`` is synced first (``jax_state_sync``), so a callback saves what
  training holds. Values are assigned in place (``Variable.assign``).
- **Flax NNX** modules, ``nnx.Optimizer`` and every ``nnx.Pytree``: each ``nnx.Variable``
  (``Param``, ``BatchStat``, RNG keys and counts, optimizer state) at its graph path
  (``l1/kernel``, ``opt_state/0/mu/l1/kernel``), set in place (``set_value``), on the
  device and sharding it held; ``nnx.State`` is a mapping of such variables.
- **Equinox** modules are JAX pytrees: ``graph.py`` walks their fields and rebuilds them.

An NNX module or optimizer restores whole or not at all (``whole_objects``): where the
checkpoint holds values under its path, they must be the object's own values, path for
path and shape for shape. Another optimizer (adam's ``mu``/``nu`` against SGD's momentum
``trace``, or a Lion state that shares adam's ``mu``) or another model width or depth is a
``ValueError`` naming the object and what differs on both sides, before anything is read.

A Keras layer or optimizer that is not built yet is reported as *unbuilt*: a restore that
leaves values pending installs ``install_build_hook`` on it, so its values are restored as
soon as Keras builds it (at the first call, or the optimizer's first step).

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras
    >>> from mpistrat.checkpoint.frameworks import object_children
    >>> dense = keras.layers.Dense(2); dense.build((None, 3))
    >>> [name for name, _, _ in object_children(dense)[0]]
    ['kernel', 'bias']
"""

import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from mpistrat.checkpoint import pytrees

__all__ = ["variable_parts", "object_children", "is_static", "install_build_hook",
           "nnx_roots", "whole_objects"]

Children = List[Tuple[str, Any, Optional[Callable[[Any], None]]]]


def _keras():
    return sys.modules.get("keras")


def _nnx():
    if "flax" not in sys.modules:
        return None
    return sys.modules.get("flax.nnx")


def _keras_class(*names):
    keras = _keras()
    if keras is None:
        return ()
    found = []
    for name in names:
        module, _, attr = name.rpartition(".")
        obj = keras
        for part in module.split(".") if module else ():
            obj = getattr(obj, part, None)
        if obj is not None and getattr(obj, attr, None) is not None:
            found.append(getattr(obj, attr))
    return tuple(found)


def is_static(obj: Any) -> bool:
    """Values that are configuration, never state: JAX devices, shardings, meshes."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    return isinstance(obj, (jax.Device, jax.sharding.Sharding, jax.sharding.Mesh,
                            jax.tree_util.PyTreeDef))


# -- variables -----------------------------------------------------------------------------
def variable_parts(obj: Any):
    """``(read, write, shape, dtype)`` of a Keras or NNX variable, else ``None``."""
    keras_variable = _keras_class("Variable")
    if keras_variable and isinstance(obj, keras_variable):
        return (lambda: np.asarray(obj.value), obj.assign, tuple(obj.shape),
                np.dtype(obj.dtype))
    nnx = _nnx()
    if nnx is not None and isinstance(obj, nnx.Variable):
        value = obj.get_value()
        if not pytrees.is_jax_array(value):
            return None
        shape, dtype = pytrees.jax_shape_dtype(value)
        return (lambda: pytrees.jax_read(obj.get_value()),
                lambda v: obj.set_value(pytrees.jax_rebuilt(obj.get_value(), v)), shape, dtype)
    return None


# -- objects -------------------------------------------------------------------------------
def object_children(obj: Any) -> Optional[Tuple[Children, bool]]:
    """``([(name, child, setter), ...], unbuilt)`` for a Keras or NNX object, else ``None``.
    Names may hold several segments (``a/b``)."""
    keras = _keras()
    if keras is not None:
        found = _keras_children(obj)
        if found is not None:
            return found
    nnx = _nnx()
    if nnx is not None and isinstance(obj, nnx.Pytree):
        return _nnx_children(obj, nnx), False
    return None


def _named_variables(variables, taken=()) -> Children:
    out, used = [], set(taken)
    for index, variable in enumerate(variables):
        name = variable.name if variable.name not in used else f"{variable.name}-{index}"
        used.add(name)
        out.append((name, variable, None))
    return out


def _keras_children(obj: Any) -> Optional[Tuple[Children, bool]]:
    (optimizer,) = _keras_class("optimizers.Optimizer") or (None,)
    (metric,) = _keras_class("metrics.Metric") or (None,)
    (layer,) = _keras_class("layers.Layer") or (None,)
    (seed_generator,) = _keras_class("random.SeedGenerator") or (None,)
    if optimizer is not None and isinstance(obj, optimizer):
        return _optimizer_children(obj), not obj.built
    if metric is not None and isinstance(obj, metric):
        return _named_variables(obj.variables), False
    if seed_generator is not None and isinstance(obj, seed_generator):
        return [("state", obj.state, None)], False
    if layer is None or not isinstance(obj, layer):
        return None
    if hasattr(obj, "jax_state_sync"):
        obj.jax_state_sync()       # a model in fit: its variables hold what training holds
    from mpistrat.keras.adapter import own_state
    own, generators, tracked = own_state(obj)
    children = _named_variables(own)
    for index, generator in enumerate(generators):
        children.append((f"seed_generator-{index}", generator, None))
    by_attribute = {id(v): k for k, v in vars(obj).items()
                    if not k.startswith("_") and isinstance(v, layer)}
    (input_layer,) = _keras_class("layers.InputLayer") or (None,)
    sublayers = [s for s in tracked if input_layer is None or not isinstance(s, input_layer)]
    for index, sub in enumerate(sublayers):   # input layers hold no state: not counted
        children.append((by_attribute.get(id(sub), f"layer-{index}"), sub, None))
    return children, not obj.built


def _optimizer_children(optimizer) -> Children:
    children: Children = [("iterations", optimizer.iterations, None)]
    known = {id(optimizer.iterations)}
    from mpistrat.keras.adapter import optimizer_state
    rate, slots = optimizer_state(optimizer)
    if _keras_class("Variable") and isinstance(rate, _keras_class("Variable")):
        children.append(("learning_rate", rate, None))
        known.add(id(rate))
    for name, value in slots:
        if all(isinstance(v, _keras_class("Variable")) or v is None for v in value):
            for index, variable in enumerate(value):
                if variable is not None and id(variable) not in known:
                    children.append((f"{name}/{index}", variable, None))
                    known.add(id(variable))
    rest = [v for v in optimizer.variables if id(v) not in known]
    children.extend((f"variables/{i}", v, None) for i, v in enumerate(rest))
    return children


def _nnx_children(obj: Any, nnx) -> Children:
    """Every NNX variable (and any bare JAX array) of the graph under ``obj``."""
    children: Children = []
    for path, value in nnx.graph.iter_graph(obj):
        if not path:
            continue
        name = "/".join(str(p) for p in path)
        if isinstance(value, nnx.Variable):
            children.append((name, value, None))
        elif pytrees.is_jax_array(value) or isinstance(value, np.ndarray):
            children.append((name, value, lambda v, p=path: _nnx_set(obj, p, v)))
    return children


def _nnx_set(root: Any, path, value) -> None:
    parent = root
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) or hasattr(parent, "__getitem__") and \
            not hasattr(parent, str(key)) else getattr(parent, key)
    key = path[-1]
    if isinstance(key, int) or not hasattr(parent, str(key)):
        parent[key] = value
    else:
        setattr(parent, key, value)


# -- NNX objects restore whole -------------------------------------------------------------
def nnx_roots(named: Dict[str, Any]) -> Dict[str, Any]:
    """Object path -> each outermost Flax NNX module or optimizer among a checkpoint's
    objects (found at the top, or inside dicts, lists and tuples), named as the graph
    names it::

        >>> from flax import nnx
        >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> list(nnx_roots({"train": [model], "step": 3}))
        ['train/0']
    """
    nnx = _nnx()
    found: Dict[str, Any] = {}

    def visit(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, nnx.Pytree):
            found.setdefault(path, obj)
        elif depth < 8 and isinstance(obj, dict):
            for key, value in obj.items():
                visit(value, f"{path}/{key}", depth + 1)
        elif depth < 8 and isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            for index, value in enumerate(obj):
                visit(value, f"{path}/{index}", depth + 1)

    if nnx is not None:
        for name, obj in named.items():
            visit(obj, name, 0)
    return found


def _described(value) -> str:
    """``float32[4, 8]`` for an array (a slot or a catalog entry), else its kind."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return getattr(value, "kind", "value")
    return f"{np.dtype(dtype)}{list(shape)}"


def _listed(paths, described, limit: int = 6) -> str:
    shown = ", ".join(f"{p} {described[p]}" for p in sorted(paths)[:limit])
    return shown + (f" (and {len(paths) - limit} more)" if len(paths) > limit else "")


def _difference(path: str, obj: Any, mine: Dict[str, Any], saved: Dict[str, Any]) -> str:
    """What differs between an NNX object's values and the checkpoint's under its path."""
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    parts = []
    if set(saved) - set(mine):
        parts.append("only in the checkpoint: " + _listed(
            set(saved) - set(mine), {p: _described(e) for p, e in saved.items()}))
    if set(mine) - set(saved):
        parts.append("only in the object: " + _listed(
            set(mine) - set(saved), {p: _described(s) for p, s in mine.items()}))
    shapes = sorted(p for p in set(mine) & set(saved)
                    if getattr(mine[p], "shape", None) is not None
                    and tuple(mine[p].shape) != tuple(saved[p].shape))
    if shapes:
        parts.append("other shapes: " + ", ".join(
            f"{p} (checkpoint {_described(saved[p])}, object {_described(mine[p])})"
            for p in shapes[:6]) + (f" (and {len(shapes) - 6} more)" if len(shapes) > 6 else ""))
    return f"{path!r} ({kind}): " + "; ".join(parts) if parts else ""


def whole_objects(named: Dict[str, Any], slots, catalog, check: Callable) -> Callable:
    """``check(slot, entry, path, source)`` (the per-value check of a restore), first
    checking once that every NNX module or optimizer of ``named`` that has values in
    ``catalog`` (the checkpoint's path -> entry) matches them whole: the same value paths
    under it and the same shapes, else one ``ValueError`` naming each such object and, on
    both sides, the paths and shapes that differ. An object with no value in the checkpoint
    is left to the load status (a model-only checkpoint restored beside an optimizer).
    Called inside the ranks' agreement of a restore, so every rank raises together.

        >>> checked = whole_objects({}, {}, {}, lambda *args: "checked")
        >>> checked(None, None, "w", "f.h5")
        'checked'
    """
    done = []

    def checked(slot, entry, path: str, source: str):
        if not done:
            done.append(True)
            problems = []
            for root, obj in sorted(nnx_roots(named).items()):
                prefix = root + "/"
                saved = {p[len(prefix):]: e for p, e in catalog.items() if p.startswith(prefix)}
                mine = {p[len(prefix):]: s for p, s in slots.items() if p.startswith(prefix)}
                if saved and mine:
                    problems.append(_difference(root, obj, mine, saved))
            problems = [p for p in problems if p]
            if problems:
                raise ValueError(
                    f"cannot restore from {source}: Flax NNX objects differ from the ones "
                    f"saved, {' | '.join(problems)}. Build each as it was saved (the same "
                    f"model width and depth, the same optax transformation) on every rank; to "
                    f"restore the model alone, leave the optimizer out of the Checkpoint and "
                    f"call expect_partial() on the status")
        return check(slot, entry, path, source)

    return checked


# -- restore-on-create ---------------------------------------------------------------------
def install_build_hook(obj: Any, key: Any, callback: Callable[[], None]) -> None:
    """Call ``callback()`` right after Keras builds ``obj`` (a layer at its first call, an
    optimizer at its first step). One hook per ``key``; a later one replaces it."""
    hooks = obj.__dict__.get("_mpistrat_build_hooks")
    if hooks is None:
        original = obj.build
        hooks = {}

        @functools.wraps(original)   # Keras reads build's signature to pass shapes
        def build(*args, **kwargs):
            result = original(*args, **kwargs)
            for hook in list(hooks.values()):
                hook()
            return result

        object.__setattr__(obj, "build", build)
        object.__setattr__(obj, "_mpistrat_build_hooks", hooks)
    hooks[key] = callback
