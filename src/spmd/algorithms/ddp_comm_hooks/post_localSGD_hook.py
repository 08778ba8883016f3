"""Alias of `spmd.ddp.post_local_sgd` at torch's module path (`ddp_comm_hooks.post_localSGD_hook`). Layer: ddp."""

from spmd.ddp.post_local_sgd import PostLocalSGDState, post_localSGD_hook

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]
