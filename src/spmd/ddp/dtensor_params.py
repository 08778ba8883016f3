"""DTensor parameters under DDP: data parallelism over tensor parallelism (Megatron's TP x DP, torch's
`DistributedDataParallel(model, device_mesh=mesh["dp"])` after `parallelize_module(model, mesh["tp"], plan)`).

Layer: ddp. Local tensor bookkeeping and one check; nothing here communicates.

Note: DDP over DTensor parameters
The ranks of DDP's group hold replicas of the same shard of each DTensor parameter (same coordinate on the
parameter's mesh, or coordinates that differ only along mesh dims where the parameter is Replicate). So DDP
works on local tensors: a bucket slot is shaped like the parameter's local shard, a gradient's local tensor is
averaged over the group, and the result is written back into the DTensor gradient, whose placements are kept.
Averaging is linear, so a gradient still Partial over the tensor-parallel ranks (a sequence-parallel norm's)
averages as its local terms. A gradient laid out with another local shape than its parameter (a vocab-sharded
embedding's, which comes out Replicate) is first redistributed to the parameter's placements: for Replicate to
Shard a local slice, no communication. The parameters stay DTensors throughout: state dicts, checkpoints,
clip_grad_norm_ and the optimizer see what they see under tensor parallelism alone (torch's DDP swaps them for
local tensors between forwards instead). A parameter sharded across DDP's ranks (fully_shard's) is refused: DDP
would average different shards.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spmd.comm.group import ProcessGroup
from spmd.tensor import DTensor, Replicate


def local_of(tensor: Tensor) -> Tensor:
    """A DTensor's local shard, or a plain tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_grad(param: nn.Parameter) -> Tensor | None:
    """The local tensor of `param.grad`, shaped like the parameter's local shard: a DTensor gradient of another
    local shape first becomes `param.grad` redistributed to the parameter's placements (see Note: DDP over
    DTensor parameters)."""
    grad = param.grad
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return grad
    if grad._local_tensor.shape != param._local_tensor.shape:
        with torch.no_grad():
            grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return grad._local_tensor


def set_grad(param: nn.Parameter, local: Tensor) -> None:
    """`param.grad = local`; for a DTensor parameter wrapped with the layout of the gradient it replaces (when that
    has `local`'s shape), else the parameter's."""
    if not isinstance(param, DTensor):
        param.grad = local
        return
    grad = param.grad
    like = grad if isinstance(grad, DTensor) and grad._local_tensor.shape == local.shape else param
    param.grad = DTensor._wrap_local(local, like._spec)


def check_replicated_across(named: list[tuple[str, nn.Parameter]], group: ProcessGroup) -> None:
    """Every DTensor parameter must be a replica on the ranks of DDP's `group` (see Note: DDP over DTensor
    parameters): ValueError naming the first that is sharded across them."""
    checked: set[tuple] = set()
    for name, param in named:
        if not isinstance(param, DTensor) or (param.device_mesh, param.placements) in checked:
            continue
        sharded = _dims_sharded_across(param, group)
        if sharded:
            mesh = param.device_mesh
            dims = [mesh.mesh_dim_names[d] if mesh.mesh_dim_names else d for d in sharded]
            raise ValueError(
                f"DistributedDataParallel on rank {group.global_rank}: parameter '{name}' is laid out "
                f"{list(param.placements)} on {mesh}, split along mesh dims {dims} across ranks of DDP's group "
                f"{group.ranks}, so DDP would average different pieces. Wrap with DDP over the data-parallel dim "
                f"only (DistributedDataParallel(model, device_mesh=mesh['dp']) after parallelize_module over "
                f"mesh['tp']), or leave sharded parameters to fully_shard")
        checked.add((param.device_mesh, param.placements))


def _dims_sharded_across(param: DTensor, group: ProcessGroup) -> list[int]:
    """The mesh dims along which `param` is not Replicate and another rank of `group` sits."""
    mesh = param.device_mesh
    mine = mesh.get_coordinate()
    if mine is None:
        return []
    dims: set[int] = set()
    for rank in group.ranks:
        hits = (mesh.mesh == rank).nonzero()
        if rank == mesh.get_rank() or not len(hits):
            continue
        theirs = hits[0].tolist()
        dims |= {d for d, (a, b) in enumerate(zip(mine, theirs)) if a != b and param.placements[d] != Replicate()}
    return sorted(dims)
