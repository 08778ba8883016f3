"""`_pre_dp_module_transform` (torch's `tensor.parallel.ddp`): make a tensor-parallel module ready for DDP.

Layer: tensor.parallel. torch's DistributedDataParallel can't reduce DTensor parameters, so torch's transform swaps
them for their local tensors (and back around each forward). spmd's DistributedDataParallel reduces DTensor
parameters as they are (each rank's shards averaged over its replicas, the parameters staying DTensors: ddp's Note:
DDP over DTensor parameters), so a module spmd's tensor parallelism made is ready as it is: the transform checks
what it is given and changes nothing, and a script written for torch's 2-D TP x DDP recipe runs unchanged.
"""

from __future__ import annotations

from torch import nn

__all__: list[str] = []


def _pre_dp_module_transform(module: nn.Module) -> None:
    """Prepare a tensor-parallel `module` for DistributedDataParallel (torch's recipe for TP x DDP): nothing to
    change in spmd, whose DDP takes DTensor parameters as they are."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"_pre_dp_module_transform: module must be an nn.Module, got {type(module).__name__}")
