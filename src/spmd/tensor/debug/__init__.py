"""Debugging DTensor programs: CommDebugMode counts the collectives a rank issues, per module, forward and
backward (torch's tensor.debug.CommDebugMode); visualize_sharding shows which ranks hold which block.

Layer: tensor (may import _core, comm, device_mesh).
"""

from spmd.tensor.debug.comm_mode import CommDebugMode
from spmd.tensor.debug.counts import CommCounts
from spmd.tensor.debug.sharding import sharding_table, visualize_sharding

__all__ = ["CommCounts", "CommDebugMode", "sharding_table", "visualize_sharding"]
