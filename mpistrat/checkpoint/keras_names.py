"""Checkpoint values found by the Keras 3 path of the variable they belong to, in a file
converted from TensorFlow (``python -m mpistrat convert``), which keeps each value's
TensorFlow name; for the values TensorFlow's structural rule on the file's paths
(``tf_structure.match_converted``) leaves unmatched.

A TensorFlow file itself is matched by its object graph's structure, as TensorFlow matches
it (``tf_structure``). A converted file holds each value at TensorFlow's first path
(``model/_functional/_operations/2/moving_mean``), which our walk of a Keras 3 model does not
spell; but it keeps each variable's own TensorFlow name (``full_name``:
``sequential/batch_normalization/moving_mean``), which is the Keras 3 variable's ``path``.
``KerasNames`` matches our Keras variables that found no value by path to the value of that
name; an optimizer variable also by its last name alone (TensorFlow prefixes a
LossScaleOptimizer's slots with scopes Keras 3 on JAX does not write), when that name is
unique on both sides and the shapes agree. Names are automatic: where they look shifted, it
warns::

    >>> names = KerasNames({"model/_functional/_operations/1/_kernel": "seq/dense/kernel"},
    ...                    lambda path: (4, 3), "ckpt-1")
    >>> names.by_full_name
    {'seq/dense/kernel': 'model/_functional/_operations/1/_kernel'}
"""

from typing import Callable, Dict

__all__ = ["KerasNames"]


def _is_keras(owner) -> bool:
    return type(owner).__module__.startswith("keras")


class KerasNames:
    """``full_names``: the file's path -> TensorFlow's ``full_name`` of that value."""

    def __init__(self, full_names: Dict[str, str], shape_of: Callable[[str], tuple],
                 source: str):
        self.shape_of, self.source = shape_of, source
        names: Dict[str, list] = {}
        for path, name in full_names.items():
            names.setdefault(name, []).append(path)
        self.by_full_name = {n: p[0] for n, p in names.items() if len(p) == 1}
        leaves: Dict[str, list] = {}
        for name, path in self.by_full_name.items():
            if "/_variables/" in f"/{path}/":   # an optimizer's own variables only
                leaves.setdefault(name.rsplit("/", 1)[-1], []).append(path)
        self.by_leaf = {n: p[0] for n, p in leaves.items() if len(p) == 1}

    def match(self, slots, found: Dict[str, str]) -> Dict[str, str]:
        """``found`` (our path -> the file's path) with our Keras variables it lacks added
        by their names (never a value ``found`` gives another); warns when automatic layer
        names look shifted."""
        found = dict(found)
        our_leaves: Dict[str, int] = {}
        for slot in slots.values():
            if _is_keras(slot.owner):
                leaf = str(getattr(slot.owner, "path", "")).rsplit("/", 1)[-1]
                our_leaves[leaf] = our_leaves.get(leaf, 0) + 1
        by_name = False
        taken = set(found.values())   # (a value the structure gave to another object)
        for path, slot in slots.items():
            owner = slot.owner
            if path in found or not _is_keras(owner):
                continue
            keras_path = str(getattr(owner, "path", ""))
            target = self.by_full_name.get(keras_path)
            leaf = keras_path.rsplit("/", 1)[-1]
            if target is None and our_leaves.get(leaf) == 1 and leaf in self.by_leaf and \
                    tuple(self.shape_of(self.by_leaf[leaf])) == \
                    tuple(getattr(owner, "shape", ())):
                target = self.by_leaf[leaf]     # (a slot's name holds its variable's)
            if target is not None and target not in taken:
                found[path], by_name = target, True
                taken.add(target)
        if by_name:
            self._warn_shifted_names(slots, found)
        return found

    def _warn_shifted_names(self, slots, found: Dict[str, str]) -> None:
        """Keras 3 variables matched by their paths (``dense_1/kernel``): Keras numbers the
        automatic layer names per process, so a model built after one more layer was made
        gets ``dense_1`` for what the checkpoint calls ``dense``, and a same-shaped value
        lands on the wrong layer. The sign: a Keras variable of ours left without a value
        while a checkpoint value of the same kind (``kernel``, ``bias``) and shape went
        unused. Warned (a restore into another model on purpose, a new head, looks the
        same), with both names."""
        import warnings
        used = set(found.values())
        unused: Dict[tuple, list] = {}
        for name, checkpoint_path in self.by_full_name.items():
            if checkpoint_path not in used:
                unused.setdefault((name.rsplit("/", 1)[-1],
                                   tuple(self.shape_of(checkpoint_path))), []).append(name)
        for path, slot in sorted(slots.items()):
            owner = slot.owner
            if path in found or not _is_keras(owner):
                continue
            ours = str(getattr(owner, "path", ""))
            kind = (ours.rsplit("/", 1)[-1], tuple(getattr(owner, "shape", ())))
            if unused.get(kind):
                warnings.warn(
                    f"restoring {self.source}: our Keras variable {ours!r} ({path}) found no "
                    f"value, while the checkpoint's {unused[kind][0]!r} of the same shape went "
                    f"unused: Keras's automatic layer names have probably shifted (a layer or "
                    f"model was made before this one in the process), so other variables may "
                    f"have received another layer's values. Build the model as it was saved, "
                    f"e.g. after keras.backend.clear_session(), or give its layers names",
                    RuntimeWarning, stacklevel=5)
                return
