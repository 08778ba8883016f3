"""Alias of `spmd.fsdp` under torch's older FSDP2 path (`_composable.fsdp`), so scripts
written before FSDP2 moved port by swapping the package name. Layer: fsdp (an alias; it holds no logic)."""

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
