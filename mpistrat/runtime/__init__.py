"""Layer 1: the private communicator, node layout, device binding, abort handling and the
timeline that every layer records into."""

from mpistrat.runtime.world import World, get_world, node_layout
from mpistrat.runtime.abort import install_abort_hook
from mpistrat.runtime import timeline

__all__ = ["World", "get_world", "node_layout", "install_abort_hook", "timeline"]
