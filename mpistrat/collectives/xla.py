"""XLA collectives through JAX: the collectives of code running inside ``TPUStrategy.run``.

They are called on traced values inside a ``shard_map`` body over the
one-axis replica mesh (``axis_name``), so XLA lowers them to the devices'
own collectives (ICI on TPUs, NCCL on GPUs, gloo across CPU hosts); no data
goes through MPI. Nests are mapped leaf by leaf::

    def body(x):                                   # inside shard_map(..., mesh)
        total = all_reduce(x, ReduceOp.SUM, "replica", num_replicas=8)
        rows = all_gather(x, 0, "replica")

JAX is imported only when one of these is called.
"""

from typing import Any

from mpistrat.collectives.reduce_op import ReduceOp
from mpistrat.errors import InvalidArgumentError

__all__ = ["all_reduce", "all_gather", "broadcast_from", "replica_id"]


def _tree_map(fn, value: Any) -> Any:
    import jax
    return jax.tree_util.tree_map(fn, value)


def all_reduce(value: Any, op, axis_name: str, num_replicas: int) -> Any:
    """Combine every leaf over the replicas; ``MEAN`` divides by ``num_replicas``.

    Integer means truncate toward zero, as TensorFlow's ``Div`` does.
    """
    import jax.numpy as jnp
    from jax import lax
    op = ReduceOp.from_any(op)

    def one(leaf):
        x = jnp.asarray(leaf)
        if op is ReduceOp.MIN:
            return lax.pmin(x, axis_name)
        if op is ReduceOp.MAX:
            return lax.pmax(x, axis_name)
        total = lax.psum(x, axis_name)
        if op is ReduceOp.SUM:
            return total
        if jnp.issubdtype(total.dtype, jnp.integer):
            return lax.div(total, jnp.asarray(num_replicas, total.dtype))
        return total / num_replicas

    return _tree_map(one, value)


def all_gather(value: Any, axis: int, axis_name: str) -> Any:
    """Concatenate every leaf over the replicas along ``axis``, in replica order.

    Inside one compiled program every replica has the same shapes, as
    ``TPUStrategy`` requires; scalars and out-of-range axes raise ``ValueError``.
    """
    import jax.numpy as jnp
    from jax import lax

    def one(leaf):
        x = jnp.asarray(leaf)
        if x.ndim == 0:
            raise InvalidArgumentError(
                "all_gather: a scalar (rank-0) value cannot be concatenated along an axis; "
                "reshape it to [1] first, or use all_reduce")
        if not -x.ndim <= axis < x.ndim:
            raise InvalidArgumentError(
                f"all_gather: axis {axis} is out of range for a value of shape {x.shape}")
        return lax.all_gather(x, axis_name, axis=axis % x.ndim, tiled=True)

    return _tree_map(one, value)


def broadcast_from(value: Any, replica: int, axis_name: str) -> Any:
    """Every replica receives replica ``replica``'s value of every leaf."""
    import jax.numpy as jnp
    from jax import lax

    def one(leaf):
        x = jnp.asarray(leaf)
        carrier = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
        mine = lax.axis_index(axis_name) == replica
        shared = lax.psum(jnp.where(mine, carrier, jnp.zeros_like(carrier)), axis_name)
        return shared.astype(x.dtype)

    return _tree_map(one, value)


def replica_id(axis_name: str) -> Any:
    """This replica's global id, as a traced ``int32``."""
    from jax import lax
    return lax.axis_index(axis_name)
