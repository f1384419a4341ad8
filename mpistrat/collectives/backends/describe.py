"""Which backend and algorithm each kind and size of array would get, and why.

A pure function of the capabilities and the topology, for ``python -m
mpistrat info`` and for users wondering why a collective took a path::

    >>> from mpistrat.collectives.backends.describe import describe_backends
    >>> from mpistrat.runtime.devices import Capabilities
    >>> row = describe_backends(2, caps=Capabilities(False, False), kinds=("numpy",),
    ...                         sizes=(64 << 20,))[0]
    >>> row["backend"], row["algorithm"]
    ('host-mpi', 'ring')
"""

from typing import Dict, List, Optional, Sequence

from mpistrat.collectives.backends import explain_backend
from mpistrat.collectives.options import CommunicationImplementation
from mpistrat.collectives.topology import Topology, single_node

__all__ = ["describe_backends", "DEFAULT_SIZES"]

DEFAULT_SIZES = (4 << 10, 1 << 20, 256 << 20)


def describe_backends(size: int, topology: Optional[Topology] = None, caps=None,
                      implementation="AUTO", sizes: Sequence[int] = DEFAULT_SIZES,
                      kinds: Sequence[str] = ("numpy", "cupy", "jax"),
                      algorithm: str = "auto") -> List[Dict]:
    """One row per (kind, bytes): ``backend``, ``algorithm`` and ``why`` (or ``error``).

    ``size``: ranks of the communicator; ``topology``: where they sit (one
    node by default); ``caps``: ``runtime.devices.capabilities()`` by default.
    """
    if caps is None:
        from mpistrat.runtime.devices import capabilities
        caps = capabilities()
    if isinstance(implementation, str):
        implementation = CommunicationImplementation[implementation.upper()]
    topology = topology if topology is not None else single_node(size)
    rows = []
    for kind in kinds:
        for nbytes in sizes:
            row: Dict = {"kind": kind, "bytes": int(nbytes)}
            try:
                backend, why = explain_backend(kind, implementation, caps, topology)
            except ValueError as err:
                row["error"] = str(err)
                rows.append(row)
                continue
            chosen, reason = backend.algorithm_for(nbytes, size, topology, algorithm)
            row.update(backend=backend.name, algorithm=chosen, why=f"{why}; {reason}")
            rows.append(row)
    return rows
