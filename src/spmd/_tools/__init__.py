"""Tools at torch's `_tools` path: MemTracker (a step's tensor memory by category and module), FSDPMemTracker
(the same for a model sharded by spmd's fully_shard, in FSDP's categories), ModTracker (which modules are
running) and RuntimeEstimator (a step's compute time per op and module, estimated under FakeTensorMode).

Layer: _tools (may import _core, comm, tensor, fsdp). Ported code swaps torch's `_tools` package for `spmd._tools`.
"""

from spmd._tools.fsdp2_mem_tracker import FSDPMemTracker
from spmd._tools.mem_tracker import MemTracker
from spmd._tools.mod_tracker import ModTracker
from spmd._tools.runtime_estimator import RuntimeEstimator

__all__ = ["FSDPMemTracker", "MemTracker", "ModTracker", "RuntimeEstimator"]
