"""Alias of `spmd.tensor.placement` under torch's older path (`_tensor.placement_types`), which also holds the
spec types there (torchtune imports `DTensorSpec` and `TensorMeta` from it). Layer: tensor."""

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["DTensorSpec", "Partial", "Placement", "Replicate", "Shard", "TensorMeta"]
