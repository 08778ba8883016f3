"""Alias of `spmd.ddp.comm_hooks` at torch's module path (`ddp_comm_hooks.default_hooks`). Layer: ddp."""

from spmd.ddp.comm_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)

__all__ = ["allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
           "fp16_compress_wrapper"]
