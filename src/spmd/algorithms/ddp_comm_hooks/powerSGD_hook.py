"""Alias of `spmd.ddp.powersgd` at torch's module path (`ddp_comm_hooks.powerSGD_hook`). Layer: ddp."""

from spmd.ddp.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
