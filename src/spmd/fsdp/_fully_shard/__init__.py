"""Alias of `spmd.fsdp`'s FSDP2 names under torch's `fsdp._fully_shard` path, which TorchTitan and torchao
import from. Layer: fsdp (an alias; it holds no logic)."""

from spmd.fsdp.api import (
    DataParallelMeshDims,
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from spmd.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
