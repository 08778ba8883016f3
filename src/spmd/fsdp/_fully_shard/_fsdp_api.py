"""Alias of torch's `fsdp._fully_shard._fsdp_api`: FSDP2's policies and the Comm protocol of custom all-gathers and
reduce-scatters (`set_custom_all_gather`), which users subclass from this path. Layer: fsdp (an alias)."""

from spmd.fsdp.api import DataParallelMeshDims
from spmd.fsdp.comm import AllGather, Comm, ReduceScatter
from spmd.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["AllGather", "CPUOffloadPolicy", "Comm", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy",
           "ReduceScatter"]
