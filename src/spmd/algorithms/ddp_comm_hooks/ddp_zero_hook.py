"""Alias of `spmd.optim.zero_overlap` at torch's module path (`ddp_comm_hooks.ddp_zero_hook`): the hooks that step
a ZeroRedundancyOptimizer(overlap_with_ddp=True) inside DDP's backward. Layer: optim."""

from spmd.optim.zero_overlap import hook_with_zero_step, hook_with_zero_step_interleaved

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]
