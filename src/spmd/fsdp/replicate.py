"""replicate: data parallelism on FSDP2's machinery (torch 2.13's `_composable.replicate_with_fsdp.replicate`).

Layer: fsdp. Applied like fully_shard (to each block, then to the root), it keeps every parameter whole on every
rank, a Replicate() DTensor on a 1-d mesh, and all-reduces each call's gradients in one collective as soon as
that call's backward is over, overlapping the rest of backward, as DDP's buckets do. Because it is FSDP2's
machinery, it brings FSDP2's per-module API (the module's class becomes `Replicate<Class>`, a subclass of
`ReplicateModule` and so of FSDPModule): MixedPrecisionPolicy, set_requires_gradient_sync for accumulation,
set_gradient_divide_factor, prefetching, state dicts of DTensors that spmd.checkpoint saves and reshards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, overload

from torch import nn

from spmd.comm.collectives import broadcast_coalesced
from spmd.device_mesh import DeviceMesh
from spmd.fsdp.api import (
    _NO_MIXED_PRECISION,
    _NO_OFFLOAD,
    DataParallelMeshDims,
    FSDPModule,
    _check_mesh,
    _check_not_initialised,
    _default_mesh,
    _from_spmd_mesh,
    _unowned_modules,
    manage,
)
from spmd.fsdp.policy import MixedPrecisionPolicy, OffloadPolicy
from spmd.fsdp.state import FSDPState, state_of


class ReplicateModule(FSDPModule):
    """The methods every replicate module gains (its class becomes `Replicate<Class>`): FSDPModule's."""


@overload
def replicate(module: nn.Module, **kwargs: Any) -> ReplicateModule: ...
@overload
def replicate(module: list[nn.Module], **kwargs: Any) -> list[ReplicateModule]: ...


def replicate(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
              mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION, offload_policy: OffloadPolicy = _NO_OFFLOAD,
              ignored_params: set[nn.Parameter] | None = None,
              dp_mesh_dims: DataParallelMeshDims | None = None) -> Any:
    """Replicate the parameters of `module` (or of a list of modules, as one group) over the 1-d `mesh` (default:
    every rank), in place; backward all-reduces their gradients over it, averaged.

    Apply it bottom-up, like fully_shard: the parameters of one call form one group, whose gradients are
    all-reduced in one collective once its backward is over. Every parameter not owned by a call below becomes a
    Replicate() DTensor on `mesh`; forward casts it to `mp_policy.param_dtype` when one is set (a copy held until
    backward ends), else uses it as it is. Parameters (not on the meta device) and buffers start as group rank
    0's, as DDP's do, so replicas agree even if each rank initialised them differently. With `dp_mesh_dims`
    (replicate dims only), `mesh` is the job's whole mesh and tensor-parallel DTensors on it keep their other dim.
    A module already under fully_shard is refused, and so is fully_shard of a module replicate manages.
    Collective over the mesh.
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    names = ", ".join(type(m).__name__ for m in modules)
    for m in modules:
        if state_of(m) is not None:
            raise RuntimeError(f"replicate({names}): {type(m).__name__} is already managed by fully_shard or "
                               f"replicate; apply one of them once per module")
    mesh = mesh if mesh is not None else _default_mesh()
    if dp_mesh_dims is not None:
        if dp_mesh_dims.shard:
            raise ValueError(f"replicate({names}): dp_mesh_dims={dp_mesh_dims} names shard dims; replicate takes "
                             f"replicate dims only (use fully_shard to shard)")
        mesh = _from_spmd_mesh(modules, mesh, dp_mesh_dims, ignored_params or set(), caller="replicate")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        found = f"a {mesh.ndim}-d mesh" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(f"replicate({names}): mesh must be a 1-d DeviceMesh of the replicas, got {found}")
    shard_mesh = dataclasses.replace(_check_mesh(mesh, modules), replicate_only=True)
    _check_not_initialised(modules)
    state = manage(modules, shard_mesh, False, None, None, mp_policy, offload_policy, ignored_params or set(),
                   ReplicateModule)
    _start_equal(state, mesh)
    return list(modules) if isinstance(module, list) else module


replicate.state = state_of   # type: ignore[attr-defined]   # torch's `replicate.state(module)` (contract's)


def _start_equal(state: FSDPState, mesh: DeviceMesh) -> None:
    """Overwrite the call's parameters and its modules' own buffers with group rank 0's, one broadcast per dtype
    and device (meta tensors, not yet initialised, are left). Collective over the mesh."""
    group = mesh.get_group(0)
    if group.size() == 1:
        return
    tensors = [param.local_shard for param in state.params]
    tensors += [buffer for m in state.modules for _, sub in _unowned_modules(m)
                for buffer in sub._buffers.values() if buffer is not None]
    broadcast_coalesced([tensor for tensor in tensors if tensor.device.type != "meta"], group=group, group_src=0)


def is_composable_with_replicate(module: nn.Module) -> bool:
    """Whether replicate may manage `module`: not when fully_shard already does."""
    return state_of(module) is None or isinstance(module, ReplicateModule)
