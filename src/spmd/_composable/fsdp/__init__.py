"""Alias of `spmd.fsdp` under torch's older FSDP2 path (`_composable.fsdp`), so scripts
written before FSDP2 moved port by swapping the package name. Layer: fsdp (an alias; it holds no logic)."""

import spmd._composable.fsdp.fully_shard  # noqa: F401  (the module path first; the name below is the function, as in torch)
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
