"""Alias of `spmd.fsdp`'s API at torch's older module path (`_composable.fsdp.fully_shard`), which code written for
torch 2.4-2.5 imports `FSDPModule` and `fully_shard` from; the names torch's module holds. Layer: fsdp (an alias;
it holds no logic)."""

from spmd.fsdp import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
