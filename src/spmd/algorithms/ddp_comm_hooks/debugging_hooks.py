"""Alias of spmd.ddp's `noop_hook` at torch's module path (`ddp_comm_hooks.debugging_hooks`). Layer: ddp."""

from spmd.ddp.comm_hooks import noop_hook

__all__ = ["noop_hook"]
