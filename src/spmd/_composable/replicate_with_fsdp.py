"""torch 2.13's `_composable.replicate_with_fsdp`: `replicate` on FSDP2's machinery (spmd.fsdp.replicate), at
torch's module path. Layer: fsdp (an alias; it holds no logic)."""

from spmd.fsdp.replicate import ReplicateModule, is_composable_with_replicate, replicate

__all__ = ["ReplicateModule", "is_composable_with_replicate", "replicate"]
