"""Alias of `spmd.tensor.placement` under torch's older path (`_tensor.placement_types`).
Layer: tensor."""

from spmd.tensor.placement import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]
