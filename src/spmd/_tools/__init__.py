"""Memory tools at torch's `_tools` path: MemTracker (a step's tensor memory by category and module),
FSDPMemTracker (the same for a model sharded by spmd's fully_shard, in FSDP's categories) and ModTracker (which
modules are running).

Layer: _tools (may import _core, comm, tensor, fsdp). Ported code swaps torch's `_tools` package for `spmd._tools`.
"""

from spmd._tools.fsdp2_mem_tracker import FSDPMemTracker
from spmd._tools.mem_tracker import MemTracker
from spmd._tools.mod_tracker import ModTracker

__all__ = ["FSDPMemTracker", "MemTracker", "ModTracker"]
