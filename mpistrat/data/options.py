"""``ms.data.Options`` and ``AutoShardPolicy``, with tf.data's names.

    >>> from mpistrat.data import Options, AutoShardPolicy
    >>> options = Options()
    >>> options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
"""

import enum

__all__ = ["AutoShardPolicy", "DistributeOptions", "Options"]


class AutoShardPolicy(enum.Enum):
    """How ``experimental_distribute_dataset`` shards input over the ranks."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


class DistributeOptions:
    """``options.experimental_distribute``: the auto-shard policy."""

    def __init__(self):
        self.auto_shard_policy = AutoShardPolicy.AUTO


class Options:
    """Dataset options; only ``experimental_distribute.auto_shard_policy`` has an effect."""

    def __init__(self):
        self.experimental_distribute = DistributeOptions()
        self.experimental_deterministic = True
