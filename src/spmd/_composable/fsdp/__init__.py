"""Alias of `spmd.fsdp` under torch's older FSDP2 path (`_composable.fsdp`), so scripts
written before FSDP2 moved port by swapping the package name. Layer: fsdp (an alias; it holds no logic).
As in torch, the package's `fully_shard` is the function; its module is importable by path."""

from spmd._composable.fsdp.fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from spmd.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard",
           "register_fsdp_forward_method"]
