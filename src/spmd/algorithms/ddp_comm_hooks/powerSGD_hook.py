"""Alias of `spmd.ddp.powersgd` at torch's module path (`ddp_comm_hooks.powerSGD_hook`). Layer: ddp."""

from spmd.ddp.powersgd import PowerSGDState, powerSGD_hook

__all__ = ["PowerSGDState", "powerSGD_hook"]
