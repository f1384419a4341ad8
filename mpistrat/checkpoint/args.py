"""``ms.checkpoint.args``: Orbax's argument classes for the Orbax face of ``CheckpointManager``.

A save or a restore says *what* it handles by the class of its ``args``, as in Orbax:
``StandardSave``/``PyTreeSave`` save a pytree, ``StandardRestore``/``PyTreeRestore``
restore one (into the shapes of a target tree, or as saved), ``Composite`` names several
items. Options of Orbax's that mpistrat does not implement raise ``OrbaxNotSupportedError``
(a ``NotImplementedError``) when the argument is made, naming the option; so do Orbax's
other argument classes (``JsonSave``, ``ArraySave``, ...), which are here only to say so.

    >>> import numpy as np
    >>> from mpistrat.checkpoint import args
    >>> both = args.Composite(state=args.StandardSave({"w": np.zeros(2)}), extra=None)
    >>> sorted(both), both.state.item["w"].shape, "extra" in both
    (['extra', 'state'], (2,), True)
    >>> args.StandardRestore({"w": np.zeros(2)}, strict=False)
    Traceback (most recent call last):
    ...
    mpistrat.checkpoint.args.OrbaxNotSupportedError: StandardRestore(strict=False) (truncating or padding arrays to the target's shape) is not supported by mpistrat; restore into a target of the saved shapes
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterator, Optional

__all__ = ["CheckpointArgs", "StandardSave", "StandardRestore", "PyTreeSave", "PyTreeRestore",
           "Composite", "OrbaxNotSupportedError", "JsonSave", "JsonRestore", "ArraySave",
           "ArrayRestore", "ProtoSave", "ProtoRestore", "JaxRandomKeySave",
           "JaxRandomKeyRestore", "NumpyRandomKeySave", "NumpyRandomKeyRestore"]


class OrbaxNotSupportedError(NotImplementedError):
    """An Orbax feature (an option, an argument class) that mpistrat does not implement.

        >>> issubclass(OrbaxNotSupportedError, NotImplementedError)
        True
    """


def refuse(what: str, why: str, instead: str = "") -> None:
    """Raise ``OrbaxNotSupportedError`` for ``what`` (``instead``: what to do)."""
    raise OrbaxNotSupportedError(f"{what} ({why}) is not supported by mpistrat"
                                 + (f"; {instead}" if instead else ""))


def _refuse_set(owner: str, **given: Any) -> None:
    """Refuse each option given a value other than its default (``name=(value, default)``)."""
    for name, (value, default) in given.items():
        if value is default or isinstance(default, bool) and value is not None and \
                isinstance(value, (bool, int)) and bool(value) == default:
            continue
        refuse(f"{owner}({name}=...)", "an Orbax option",
               f"leave {name} at its default {default!r}")


class CheckpointArgs:
    """Base of the argument classes (``isinstance(args, CheckpointArgs)``).

        >>> isinstance(StandardSave({}), CheckpointArgs)
        True
    """


@dataclasses.dataclass
class StandardSave(CheckpointArgs):
    """Save the pytree ``item``: dicts, lists, tuples, NamedTuples, registered JAX pytree
    nodes and ``None`` holding NumPy or JAX arrays and Python or NumPy numbers. Every rank
    passes the same values (they are compared). ``save_args`` and ``custom_metadata`` are
    refused (``OrbaxNotSupportedError``).

        >>> StandardSave({"step": 3}).item
        {'step': 3}
    """

    item: Any
    save_args: Any = None
    custom_metadata: Any = None

    def __post_init__(self):
        _refuse_set(type(self).__name__, save_args=(self.save_args, None),
                    custom_metadata=(self.custom_metadata, None))


@dataclasses.dataclass
class PyTreeSave(CheckpointArgs):
    """``StandardSave`` under Orbax's other name (``save_args``,
    ``ocdbt_target_data_file_size`` and ``custom_metadata``: refused).

        >>> PyTreeSave([1.0, 2]).item
        [1.0, 2]
    """

    item: Any
    save_args: Any = None
    ocdbt_target_data_file_size: Optional[int] = None
    custom_metadata: Any = None

    def __post_init__(self):
        _refuse_set("PyTreeSave", save_args=(self.save_args, None),
                    ocdbt_target_data_file_size=(self.ocdbt_target_data_file_size, None),
                    custom_metadata=(self.custom_metadata, None))


@dataclasses.dataclass
class StandardRestore(CheckpointArgs):
    """Restore into the shapes of the target tree ``item``; ``item=None`` restores the tree
    as saved (NumPy arrays, Python numbers). Target leaves may be JAX arrays (restored as
    JAX arrays with the same sharding), ``jax.ShapeDtypeStruct`` (a NumPy array, or a JAX
    array when it has a sharding), NumPy arrays and scalars, Python numbers. Shapes and
    dtypes must be the saved ones, but for integers of another width that hold every value
    (else ``ValueError`` naming the path); ``strict=False``, ``support_layout`` and
    ``fallback_sharding`` are refused.

        >>> StandardRestore().item is None
        True
    """

    item: Any = None
    strict: bool = True
    support_layout: bool = False
    fallback_sharding: Any = None

    #: a target tree may leave out saved values (``PyTreeRestore(partial_restore=True)``)
    partial_restore = False

    def __post_init__(self):
        if not self.strict:
            refuse(f"{type(self).__name__}(strict=False)", "truncating or padding arrays to "
                   "the target's shape", "restore into a target of the saved shapes")
        _refuse_set(type(self).__name__, support_layout=(self.support_layout, False),
                    fallback_sharding=(self.fallback_sharding, None))


@dataclasses.dataclass
class PyTreeRestore(CheckpointArgs):
    """``StandardRestore`` under Orbax's other name; ``partial_restore=True`` lets the target
    leave out saved values (they are not read). ``restore_args``, ``transforms`` and
    ``legacy_transform_fn`` are refused.

        >>> PyTreeRestore({"w": None}, partial_restore=True).partial_restore
        True
    """

    item: Any = None
    restore_args: Any = None
    transforms: Any = None
    transforms_default_to_original: bool = True
    legacy_transform_fn: Any = None
    partial_restore: bool = False
    strict = True

    def __post_init__(self):
        _refuse_set("PyTreeRestore", restore_args=(self.restore_args, None),
                    transforms=(self.transforms, None),
                    transforms_default_to_original=(self.transforms_default_to_original, True),
                    legacy_transform_fn=(self.legacy_transform_fn, None))


class Composite(CheckpointArgs, Mapping):
    """Several named items: ``Composite(state=StandardSave(tree), other=...)``. Read-only;
    items by key (``c["state"]``) or attribute (``c.state``). A restore returns one too.

        >>> c = Composite(a=1, b=2)
        >>> c.a, c["b"], len(c), dict(c)
        (1, 2, 2, {'a': 1, 'b': 2})
    """

    def __init__(self, **items: Any):
        for key in items:
            if key.startswith("__"):
                raise ValueError(f"Composite keys cannot start with '__', got {key!r}")
        object.__setattr__(self, "_items", dict(items))

    def __getitem__(self, key: str) -> Any:
        if key not in self._items:
            raise KeyError(f"unknown item {key!r}; items: {sorted(self._items)}")
        return self._items[key]

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(str(err)) from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise ValueError("Composite is immutable after initialization")

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Composite({self._items!r})"


def _refused(name: str, why: str, instead: str):
    class Refused(CheckpointArgs):
        def __init__(self, *args: Any, **kwargs: Any):
            refuse(f"ocp.args.{name}", why, instead)
    Refused.__name__ = Refused.__qualname__ = name
    Refused.__doc__ = (f"Orbax's ``{name}``: refused (``OrbaxNotSupportedError``): {why}; "
                       f"{instead}.")
    return Refused


_JSON = ("JSON items", "save the values as numbers in a StandardSave tree, or write the JSON "
                       "file yourself on rank 0")
JsonSave, JsonRestore = _refused("JsonSave", *_JSON), _refused("JsonRestore", *_JSON)
_ARRAY = ("single-array items", "save the array inside a StandardSave tree")
ArraySave, ArrayRestore = _refused("ArraySave", *_ARRAY), _refused("ArrayRestore", *_ARRAY)
_PROTO = ("protocol-buffer items", "serialise the message yourself")
ProtoSave, ProtoRestore = _refused("ProtoSave", *_PROTO), _refused("ProtoRestore", *_PROTO)
_KEY = ("random-key items", "save jax.random.key_data(key) or the NumPy state's arrays in a "
                            "StandardSave tree (a typed JAX key array is saved as its key data)")
JaxRandomKeySave, JaxRandomKeyRestore = (_refused("JaxRandomKeySave", *_KEY),
                                         _refused("JaxRandomKeyRestore", *_KEY))
NumpyRandomKeySave, NumpyRandomKeyRestore = (_refused("NumpyRandomKeySave", *_KEY),
                                             _refused("NumpyRandomKeyRestore", *_KEY))
