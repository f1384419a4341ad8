"""What the Keras wrappers ask of the code around them, kept apart so that ``hooks``
(which distributes a model at compile) and ``trainer`` (which distributes it) never
import each other:

* ``global_metrics()``: within it, metrics made in a scope already hold the replicas' global
  sums (a distributed ``fit``, ``evaluate`` or ``predict``), so ``result()`` reads them as
  they are (``holds_global_sums``);
* ``reduced_here()``: within it, the gradients a ``DistributedOptimizer`` (``hvd``) is
  handed were already reduced over the ranks (a distributed ``fit``'s train step), so it
  applies them as they are (``reduced_already``);
* ``train_alone(model)``: this rank's copy may train alone where a strategy of several
  replicas exists (``fit``'s guard lets it pass)::

      with global_metrics():
          assert holds_global_sums()
"""

import contextlib
import threading
from typing import Any

__all__ = ["global_metrics", "holds_global_sums", "reduced_here", "reduced_already",
           "train_alone"]

_LOCAL = threading.local()   # .global_state: the metrics hold global sums (this thread);
                             # .reduced: depth of reduced_here (nested LossScaleOptimizer and
                             # stateless_apply calls apply as they are)


@contextlib.contextmanager
def reduced_here():
    """Within it the gradients handed to a ``DistributedOptimizer`` were already reduced over
    the ranks (a distributed ``fit``'s train step): they are applied as they are."""
    _LOCAL.reduced = getattr(_LOCAL, "reduced", 0) + 1
    try:
        yield
    finally:
        _LOCAL.reduced -= 1


def reduced_already() -> bool:
    """Whether this thread runs inside ``reduced_here``."""
    return getattr(_LOCAL, "reduced", 0) > 0


class global_metrics:
    """Within it, metrics made in a scope hold global sums already (a distributed ``fit``,
    ``evaluate`` or ``predict``): ``result()`` reads them as they are::

        with global_metrics():
            model.evaluate(x, y)
    """

    def __enter__(self):
        self._before = holds_global_sums()
        _LOCAL.global_state = True
        return self

    def __exit__(self, *exc):
        _LOCAL.global_state = self._before
        return False


def holds_global_sums() -> bool:
    """Whether this thread is inside ``global_metrics()``."""
    return getattr(_LOCAL, "global_state", False)


def train_alone(model: Any) -> Any:
    """Let ``model.fit`` train this rank's copy alone, without the strategy (e.g. a reference
    run or a per-rank fine-tune), where a strategy of several replicas exists::

        ms.keras.train_alone(model).fit(x, y)    # this rank only, nothing averaged
    """
    model._mpistrat_alone = True
    return model
