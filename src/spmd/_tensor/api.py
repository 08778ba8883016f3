"""Alias of `spmd.tensor.api` under torch's older path (`_tensor.api`). Layer: tensor."""

from spmd.tensor.api import DTensor, distribute_module, distribute_tensor

__all__ = ["DTensor", "distribute_module", "distribute_tensor"]
