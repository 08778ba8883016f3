"""Debugging DTensor programs: CommDebugMode counts the collectives a rank issues, per module, forward and
backward (torch's tensor.debug.CommDebugMode).

Layer: tensor (may import _core, comm, device_mesh).
"""

from spmd.tensor.debug.comm_mode import CommDebugMode
from spmd.tensor.debug.counts import CommCounts

__all__ = ["CommCounts", "CommDebugMode"]
