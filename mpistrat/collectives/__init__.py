"""Layer 2: collectives over host and device buffers, behind one entry point."""

from mpistrat.collectives.engine import CollectiveEngine
from mpistrat.collectives.options import (CommunicationImplementation, CommunicationOptions)
from mpistrat.collectives.reduce_op import ReduceOp, divide_for_mean

__all__ = ["CollectiveEngine", "CommunicationImplementation", "CommunicationOptions", "ReduceOp",
           "divide_for_mean"]
