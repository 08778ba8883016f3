"""Alias at torch's module path `algorithms._comm_hooks` (in torch's distributed package): FSDP1's
communication hooks (default_hooks), for FullyShardedDataParallel.register_comm_hook."""

from spmd.algorithms._comm_hooks import default_hooks

LOW_PRECISION_HOOKS = [default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook]

__all__ = ["LOW_PRECISION_HOOKS", "default_hooks"]
