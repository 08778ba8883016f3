"""Alias of `spmd.tensor` under torch's older DTensor path (`_tensor` in torch's distributed package), so
scripts that still import it port by swapping the package name. Layer: tensor (an alias; it holds no logic)."""

from spmd.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    init_device_mesh,
    ones,
    rand,
    randn,
    zeros,
)

__all__ = ["DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_module",
           "distribute_tensor", "empty", "full", "init_device_mesh", "ones", "rand", "randn", "zeros"]
