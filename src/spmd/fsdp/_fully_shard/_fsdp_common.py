"""Alias of torch's `fsdp._fully_shard._fsdp_common` names users build per-parameter meshes with
(`ShardPlacementResult`, `FSDPMeshInfo`, `HSDPMeshInfo`). Layer: fsdp (an alias)."""

from spmd.fsdp.mesh_info import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult

__all__ = ["FSDPMeshInfo", "HSDPMeshInfo", "ShardPlacementResult"]
