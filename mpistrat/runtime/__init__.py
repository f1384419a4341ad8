"""Layer 1: the private communicator, node layout, device binding and abort handling."""

from mpistrat.runtime.world import World, get_world, node_layout
from mpistrat.runtime.abort import install_abort_hook

__all__ = ["World", "get_world", "node_layout", "install_abort_hook"]
