"""torch's `_state_dict_utils` helpers, which training code imports (TorchTitan's async checkpoints with pinned
memory, torchtune's full-weight gathering): walk a state dict's nested dicts, lists and tuples and gather,
offload, copy or allocate its tensors (DTensors kept as DTensors where the helper keeps them), or lay full
tensors out as the DTensors of a sharded state dict.

Layer: the tensor layer (may import _core, comm, device_mesh, tensor); collective only where a helper gathers or
broadcasts (its docstring says so).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from spmd.comm.world import AnyGroup, get_rank
from spmd.tensor import DTensor, distribute_tensor
from spmd.tensor._utils import compute_local_shape_and_global_offset

_PLAIN = (int, float, str, bytes, io.BytesIO)


class CompanionMismatch(Exception):
    """Two state dicts that should have one structure (keys, lengths, tensor sizes and dtypes) do not."""


def _walk(value: Any, leaf: Callable[[Tensor, Any], Any], companion: Any = None, type_check: bool = True,
          path: str = "") -> Any:
    """`value` with every tensor replaced by `leaf(tensor, its companion)`; `companion`, when given, must have
    the same structure (a CompanionMismatch naming the path otherwise)."""
    if isinstance(value, Tensor):
        return leaf(value, companion)
    if value is None or isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        if companion is not None and (not isinstance(companion, dict) or companion.keys() != value.keys()):
            raise CompanionMismatch(f"at {path or 'the top'}: keys differ")
        return {key: _walk(item, leaf, None if companion is None else companion[key], type_check, f"{path}.{key}")
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        if companion is not None and (not isinstance(companion, (list, tuple)) or len(companion) != len(value)):
            raise CompanionMismatch(f"at {path or 'the top'}: lengths differ")
        items = [_walk(item, leaf, None if companion is None else companion[index], type_check, f"{path}[{index}]")
                 for index, item in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if type_check:
        raise ValueError(f"state dict: unexpected value type {type(value).__name__} at {path or 'the top'} "
                         f"(tensors, DTensors, numbers, strings, bytes, lists, tuples, dicts and None are "
                         f"served; pass type_check=False to deep-copy others)")
    return copy.deepcopy(value)


def _only_on(ranks_only: tuple[int, ...], pg: AnyGroup | None, result: dict[str, Any]) -> dict[str, Any]:
    return result if not ranks_only or get_rank(pg) in ranks_only else {}


def _gather_state_dict(state_dict: dict[str, Any], *, pg: AnyGroup | None = None, device: torch.device | None = None,
                       cpu_offload: bool = False, ranks_only: tuple[int, ...] = (),
                       type_check: bool = True) -> dict[str, Any]:
    """The state dict with every DTensor gathered into its full tensor (collective over each DTensor's mesh, on
    every rank, in the same order); with `cpu_offload` every tensor on the CPU; with `ranks_only`, ranks not in
    it get {}. `device` is accepted for torch's ShardedTensors, which spmd has none of."""

    def gather(tensor: Tensor, _: Any) -> Tensor:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return full.cpu() if cpu_offload else full

    return _only_on(ranks_only, pg, _walk(state_dict, gather, type_check=type_check))


def _offload_state_dict_to_cpu(state_dict: dict[str, Any], *, ranks_only: tuple[int, ...] = (),
                               type_check: bool = True) -> dict[str, Any]:
    """The state dict with every tensor copied to the CPU (a DTensor stays one, its local tensor on the CPU);
    with `ranks_only`, ranks not in it get {}."""
    return _only_on(ranks_only, None, _walk(state_dict, lambda tensor, _: tensor.cpu(), type_check=type_check))


def _copy_state_dict(state_dict: dict[str, Any], copy_state_dict: dict[str, Any], non_blocking: bool = False,
                     type_check: bool = True) -> dict[str, Any]:
    """Copy every tensor of `state_dict` into the tensor at the same place of `copy_state_dict` (same structure,
    sizes and dtypes; a DTensor's local tensor into the other's), and return the structure holding the copies
    (TorchTitan's async staging into pinned buffers made by _create_cpu_state_dict)."""

    def copy_into(tensor: Tensor, target: Any) -> Tensor:
        if not isinstance(target, Tensor):
            raise CompanionMismatch(f"a tensor of shape {tuple(tensor.shape)} has a {type(target).__name__} to be "
                                    f"copied into")
        if isinstance(target, DTensor) != isinstance(tensor, DTensor):
            raise CompanionMismatch("a DTensor and a plain tensor at the same place")
        source = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        (target._local_tensor if isinstance(target, DTensor) else target).copy_(source, non_blocking=non_blocking)
        return target

    return _walk(state_dict, copy_into, copy_state_dict, type_check)


def _create_cpu_state_dict(state_dict: dict[str, Any], pin_memory: bool = False,
                           share_memory: bool = False) -> dict[str, Any]:
    """A state dict of the same structure whose tensors are new, uninitialised CPU tensors of the same sizes and
    dtypes (a DTensor's with the same layout): buffers to stage into, page-locked with `pin_memory` (where an
    accelerator is present: without one there is nothing to pin for), in shared memory with `share_memory`."""
    pin = pin_memory and torch.accelerator.is_available()

    def allocate(local: Tensor) -> Tensor:
        if local.dim() == 0:
            return torch.tensor(0, dtype=local.dtype)
        made = torch.empty(tuple(local.shape), dtype=local.dtype)
        if share_memory:
            made.share_memory_()
            if pin and made.numel():
                torch.cuda.cudart().cudaHostRegister(made.data_ptr(), made.numel() * made.element_size(), 0)
        elif pin and made.numel():
            made = made.pin_memory()
        return made

    def create(tensor: Tensor, _: Any) -> Tensor:
        if not isinstance(tensor, DTensor):
            return allocate(tensor)
        return DTensor.from_local(allocate(tensor._local_tensor), tensor.device_mesh, tensor.placements,
                                  run_check=False, shape=tensor.shape, stride=tensor.stride())

    return _walk(state_dict, create, type_check=False)


def _check_state_dict_similarity(state_dict: dict[str, Any], compared_state_dict: dict[str, Any]) -> bool:
    """Whether the two state dicts have one structure, with tensors of the same sizes and dtypes at each place."""

    def compare(tensor: Tensor, other: Any) -> Tensor:
        if not isinstance(other, Tensor) or other.dtype != tensor.dtype or other.size() != tensor.size():
            raise CompanionMismatch
        return tensor

    try:
        _walk(state_dict, compare, compared_state_dict, type_check=False)
    except CompanionMismatch:
        return False
    return True


class _TensorInfo(NamedTuple):
    """A tensor's size and dtype, sent ahead of its values."""

    size: torch.Size
    dtype: torch.dtype


def _distribute_tensors(local_state_dict: dict[str, Any], keys: list[str], device: torch.device,
                        pg: AnyGroup | None = None) -> None:
    """For each of `keys` whose value is a pair (a DTensor of the sharded state dict, the full tensor), put in
    its place this rank's piece of the full tensor: copied into the DTensor's local tensor, or, for a DTensor on
    the meta device, as a new DTensor of the same layout. Local: each rank slices its own piece."""
    for key in keys:
        value = local_state_dict.get(key)
        if value is None or isinstance(value, Tensor):
            continue
        local, full = value
        shape, offset = compute_local_shape_and_global_offset(full.shape, local.device_mesh, local.placements)
        piece = full[tuple(slice(start, start + length) for length, start in zip(shape, offset, strict=True))]
        if local.device.type == "meta":
            local_state_dict[key] = DTensor.from_local(piece.detach().to(device).clone(), local.device_mesh,
                                                       local.placements, run_check=False, shape=local.shape,
                                                       stride=local.stride())
        else:
            local._local_tensor.copy_(piece)
            local_state_dict[key] = local


def _distribute_state_dict(full_state_dict: dict[str, Any], local_state_dict: dict[str, Any],
                           device: torch.device, pg: AnyGroup | None = None) -> None:
    """Fill `local_state_dict` from `full_state_dict`, which every rank holds: non-tensors as they are, scalars
    on the CPU, each full tensor laid out as the DTensor at its key (distribute_tensor onto its mesh and
    placements: collective over its mesh) or moved to `device` where the key holds a plain tensor. Keys
    `local_state_dict` lacks are skipped for tensors."""
    for key, value in full_state_dict.items():
        if not isinstance(value, Tensor):
            local_state_dict[key] = value
        elif value.dim() == 0:
            local_state_dict[key] = value.cpu()
        elif key in local_state_dict:
            local = local_state_dict[key]
            if isinstance(local, DTensor):
                local_state_dict[key] = distribute_tensor(value.detach().to(device), local.device_mesh,
                                                          local.placements)
            else:
                local_state_dict[key] = value.detach().to(device)
