"""Keras 3 (JAX backend) under a strategy: ``fit``/``evaluate``/``predict`` data parallel.

``import mpistrat`` imports this package but not Keras (an optional extra): the names below
are loaded on first use, so that importing ``mpistrat.keras.adapter`` (which the checkpoint
layer does) runs nothing above it. The modules, one concept each:

* ``trainer.py``: ``distribute_model`` and its ``DistributedTrainer`` (the model's
  ``fit``/``evaluate``/``predict`` with each rank's share of the data), ``mirror_weights``;
* ``hooks.py``: where mpistrat hooks into Keras's classes (``compile`` inside a scope
  distributes the model; ``fit`` of a model not distributed is refused);
* ``steps.py``: the train and test steps of a distributed model;
* ``checks.py``: what the ranks agree on before Keras trains;
* ``callbacks.py``: the callbacks ``fit`` runs under a strategy;
* ``sync_bn.py``: ``SyncBatchNormalization``;
* ``context.py``: what the wrappers share without importing each other (``train_alone``);
* ``adapter.py``: the one place that uses Keras's private API.

Public names::

    ms.keras.distribute_model(model, strategy)   # compiled outside any scope
    ms.keras.train_alone(model).fit(x, y)        # this rank alone, on purpose
    ms.keras.SyncBatchNormalization()            # statistics of the global batch
"""

from typing import Any

__all__ = ["distribute_model", "DistributedTrainer", "mirror_weights", "train_alone",
           "SyncBatchNormalization"]


def __getattr__(name: str) -> Any:
    if name in __all__:   # (loaded on first use; SyncBatchNormalization imports Keras)
        from mpistrat.keras import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'mpistrat.keras' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
