"""Alias of `spmd.fsdp` at torch's older module path (`_composable.fsdp.fully_shard`), which code written for
torch 2.4-2.5 imports `FSDPModule` and `fully_shard` from. Layer: fsdp (an alias; it holds no logic)."""

from spmd.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard",
           "register_fsdp_forward_method"]
