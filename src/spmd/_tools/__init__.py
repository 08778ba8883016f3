"""Memory tools at torch's `_tools` path: MemTracker (a step's tensor memory by category and module) and
ModTracker (which modules are running).

Layer: _tools (may import _core, comm, tensor, fsdp). Ported code swaps torch's `_tools` package for `spmd._tools`.
"""

from spmd._tools.mem_tracker import MemTracker
from spmd._tools.mod_tracker import ModTracker

__all__ = ["MemTracker", "ModTracker"]
