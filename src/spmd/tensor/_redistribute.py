"""torch's private `tensor._redistribute.redistribute_local_tensor`, which TorchTitan's SimpleFSDP calls: a local
tensor laid out as one spec, moved to another spec's placements by spmd's planner. Layer: tensor."""

from __future__ import annotations

from torch import Tensor

from spmd.tensor.redistribute import run_plan
from spmd.tensor.spec import DTensorSpec


def redistribute_local_tensor(local_tensor: Tensor, current_spec: DTensorSpec, target_spec: DTensorSpec, *,
                              async_op: bool = False, use_graph_based_transform: bool | None = None,
                              is_explicit: bool = False) -> Tensor:
    """`local_tensor` (this rank's piece under `current_spec`) as this rank's piece under `target_spec`'s
    placements, on the same mesh. Collective over the mesh. The keyword options are torch's, accepted and not needed:
    spmd's result is complete when returned."""
    if current_spec.mesh != target_spec.mesh:
        raise ValueError(f"redistribute_local_tensor: the specs are on different meshes ({current_spec.mesh} and "
                         f"{target_spec.mesh}); a local tensor moves between placements on one mesh")
    return run_plan(local_tensor, current_spec, target_spec.placements)


__all__ = ["redistribute_local_tensor"]
