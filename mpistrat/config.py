"""``ms.config``: connecting to a cluster, and the devices this process sees.

    >>> import mpistrat as ms
    >>> ms.config.experimental_connect_to_cluster(ms.cluster_resolver.MPIClusterResolver())
    >>> ms.config.list_physical_devices("CPU")
    [PhysicalDevice(name='/physical_device:CPU:0', device_type='CPU')]
"""

from mpistrat.runtime import get_world
from mpistrat.runtime.gpus import PhysicalDevice, list_physical_devices

__all__ = ["experimental_connect_to_cluster", "list_physical_devices", "PhysicalDevice"]

_connected = []


def experimental_connect_to_cluster(cluster_spec_or_resolver, job_name="localhost",
                                    task_index=0, protocol=None, make_master_device_default=True):
    """Check that the resolver's cluster is this MPI job (MPI is already connected).

    Raises ``ValueError`` naming both sizes when the cluster and the MPI job differ.
    """
    resolver = cluster_spec_or_resolver
    check = getattr(resolver, "check_matches_world", None)
    if check is not None:
        check(get_world())
    _connected.append(resolver)
