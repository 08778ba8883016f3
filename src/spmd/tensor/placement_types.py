"""Alias of `spmd.tensor.placement` at torch's module name (`tensor.placement_types`). Layer: tensor."""

from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["Partial", "Placement", "Replicate", "Shard", "_StridedShard"]
