"""FSDP2: `fully_shard` shards each parameter as a DTensor over a DeviceMesh, gathering a group's parameters
for its forward and backward and reduce-scattering its gradients, with the API names of torch's FSDP2.

Layer: fsdp (L4; may import _core, _autograd, comm, device_mesh, tensor). Ported code swaps
torch's fsdp package for `spmd.fsdp`.
"""

from spmd.fsdp.api import (
    DataParallelMeshDims,
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from spmd.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
