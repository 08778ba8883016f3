"""Alias of torch's `fsdp._fully_shard._fully_shard`: fully_shard and FSDPModule. Layer: fsdp (an alias)."""

from spmd.fsdp.api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
