"""A rank's batches on their way to the replicas: layouts of 0-row batches, devices, PerReplica.

* ``Spec``/``spec_of``/``empty_like``: the inner shape and dtype of each
  component, so a rank with a 0-row step yields arrays of the right layout
  (dtypes kept as they are: bfloat16 stays bfloat16).
* ``gpu_of``/``to_gpu``: batches copied to this rank's GPU on a stream of their
  own; ``staged``: batches laid out on a TPUStrategy's devices ahead of the step.
* ``regroup``: one component per local replica -> the batch's structure with
  ``PerReplica`` leaves.

    >>> import numpy as np
    >>> from mpistrat.distribute.input_staging import spec_of, empty_like
    >>> empty_like(spec_of((np.zeros((3, 2), np.float32),)))[0].shape
    (0, 2)
"""

from typing import Any, Callable, Iterator

import numpy as np

from mpistrat import nest
from mpistrat.distribute.values import PerReplica

__all__ = ["Spec", "spec_of", "empty_like", "Prepared", "staged", "regroup", "gpu_of", "to_gpu"]


class Spec:
    """The inner shape and dtype of one component (a leaf for ``nest``; picklable)."""

    def __init__(self, x):
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # CuPy: no host copy
        self.inner, self.dtype = tuple(np.shape(x)[1:]), np.dtype(dtype)

    def empty(self) -> np.ndarray:
        return np.empty((0,) + tuple(self.inner), self.dtype)


def spec_of(components: tuple) -> tuple:
    return tuple(nest.map_structure(Spec, c) for c in components)


def empty_like(spec: tuple) -> tuple:
    return tuple(nest.map_structure(lambda s: s.empty(), c) for c in spec)


class Prepared(tuple):
    """``(components, device arrays per leaf)`` made by the prefetch thread."""


def staged(local: Iterator, stage: Callable) -> Iterator:
    for components in local:
        if not isinstance(components, tuple):   # a marker (a 0-row step without a layout)
            yield components
            continue
        columns = zip(*[nest.flatten(c) for c in components])
        yield Prepared((components, [stage(parts) for parts in columns]))


def regroup(components: tuple, device_arrays, replica_ids) -> Any:
    """One component per local replica -> the batch's structure with ``PerReplica`` leaves
    (a ``(features, labels)`` batch unpacks into two ``PerReplica``, as in TensorFlow)."""
    columns = list(zip(*[nest.flatten(c) for c in components]))
    values = [PerReplica(parts, replica_ids) for parts in columns]
    for value, array in zip(values, device_arrays or ()):
        value._device_array = array
    if not isinstance(components[0], (dict, list, tuple)):
        return values[0]
    return nest.pack_sequence_as(components[0], values)


def gpu_of(strategy):
    """The GPU ordinal of this rank's replica when batches should go there, else ``None``."""
    devices = strategy.extended.worker_devices
    if not devices or "GPU:" not in devices[0]:
        return None
    from mpistrat.runtime.devices import cupy_available
    if not cupy_available():
        return None
    return int(devices[0].rsplit("GPU:", 1)[1])


def to_gpu(local: Iterator, device: int) -> Iterator:
    """Each component's leaves as CuPy arrays on ``device``, copied on a stream of its own
    (this runs in the prefetch thread; the stream is synchronised before the batch is handed
    over, so the step sees complete data)."""
    import cupy
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        for components in local:
            if not isinstance(components, tuple):
                yield components
                continue
            with stream:
                moved = tuple(nest.map_structure(cupy.asarray, c) for c in components)
            stream.synchronize()
            yield moved
