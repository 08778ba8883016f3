"""input_reshard (torch's name): keep what a tensor-parallel module saves for backward sharded over the TP ranks,
and gather it back when backward needs it.

Layer: tensor.parallel. Under tensor parallelism every TP rank holds the same input (replicated), so the copy
autograd saves of it (for backward, or for activation checkpointing's recomputation) need not be whole on
each: while the module's forward runs, a tensor it saves that is replicated (a Replicate DTensor, or a plain
tensor, taken to be equal on every TP rank) is kept as this rank's Shard(input_reshard_dim) piece, 1/tp of it,
and all-gathered when backward unpacks it. A plain tensor must really be the same on every TP rank (the module's
input is); one that differs would come back as the ranks' pieces put together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from spmd.device_mesh import DeviceMesh
from spmd.tensor import DTensor
from spmd.tensor.placement import Replicate, Shard


@dataclasses.dataclass(frozen=True)
class _Resharded:
    """A saved tensor kept as this rank's piece: enough to rebuild it whole (its DTensor form, if it had one)."""

    piece: DTensor
    was_dtensor: bool


def input_reshard(module: nn.Module, tp_device_mesh: DeviceMesh, input_reshard_dim: int | None = None) -> nn.Module:
    """Make `module` keep the replicated tensors its forward saves sharded on `input_reshard_dim` over
    `tp_device_mesh`, gathered again in backward (see the module docstring); None leaves it as it is. Returns
    `module`."""
    if input_reshard_dim is None:
        return module
    hooks: list[Any] = []        # the saved-tensor hooks of the forwards running now (nested calls stack)

    def pack(tensor: Tensor) -> Any:
        return _pack(tp_device_mesh, input_reshard_dim, tensor)

    def enter(_module: nn.Module, _args: tuple) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        context.__enter__()
        hooks.append(context)

    def leave(_module: nn.Module, _args: tuple, _output: Any) -> None:
        hooks.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module


@torch.no_grad()
def _pack(mesh: DeviceMesh, dim: int, tensor: Tensor) -> Any:
    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh or not all(isinstance(p, Replicate) for p in tensor.placements) \
                or tensor.dim() <= dim:
            return tensor
        return _Resharded(tensor.detach().redistribute(placements=[Shard(dim)]), was_dtensor=True)
    if tensor.dim() <= dim or tensor.numel() < mesh.size():
        return tensor
    whole = DTensor.from_local(tensor.detach(), mesh, [Replicate()], run_check=False)
    return _Resharded(whole.redistribute(placements=[Shard(dim)]), was_dtensor=False)


@torch.no_grad()
def _unpack(saved: Any) -> Tensor:
    if not isinstance(saved, _Resharded):
        return saved
    whole = saved.piece.redistribute(placements=[Replicate()])
    return whole if saved.was_dtensor else whole.to_local()
