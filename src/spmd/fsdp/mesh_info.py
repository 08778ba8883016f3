"""Where shard_placement_fn may put a parameter (torch 2.13's per-parameter mesh): `ShardPlacementResult` names a
Shard placement and the mesh to shard over, as `FSDPMeshInfo` (a 1-d mesh) or `HSDPMeshInfo` (a 2-d (replicate,
shard) mesh). Mixture-of-experts models shard their experts over another mesh than the rest of the block.

Layer: fsdp. A fully_shard call whose parameters land on several meshes makes one parameter group per mesh:
each all-gathers and reduce-scatters over its own mesh, and the call's hooks drive them all.
"""

from __future__ import annotations

import dataclasses

from spmd.device_mesh import DeviceMesh
from spmd.tensor.placement import Shard


@dataclasses.dataclass(frozen=True)
class FSDPMeshInfo:
    """A mesh to shard over: `shard_mesh_dim` is its shard dim, `replicate_mesh_dim` (HSDP) its replica dim."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None:
            raise ValueError("FSDPMeshInfo: shard_mesh_dim must be given (the mesh dim to shard over)")
        layout = (self.shard_mesh_dim,) if self.replicate_mesh_dim is None else \
            (self.replicate_mesh_dim, self.shard_mesh_dim)
        if self.mesh.ndim != len(layout) or layout != tuple(range(self.mesh.ndim)):
            raise ValueError(f"FSDPMeshInfo: spmd shards over a 1-d mesh (shard_mesh_dim=0) or a 2-d (replicate, "
                             f"shard) mesh (replicate_mesh_dim=0, shard_mesh_dim=1); got a {self.mesh.ndim}-d mesh "
                             f"with shard_mesh_dim={self.shard_mesh_dim}, replicate_mesh_dim="
                             f"{self.replicate_mesh_dim}")


@dataclasses.dataclass(frozen=True)
class HSDPMeshInfo(FSDPMeshInfo):
    """A 2-d (replicate, shard) mesh to shard over."""


@dataclasses.dataclass(frozen=True)
class ShardPlacementResult:
    """What shard_placement_fn may return for a parameter: its Shard placement (None: Shard(0)) and its mesh."""

    placement: Shard | None
    mesh_info: FSDPMeshInfo
