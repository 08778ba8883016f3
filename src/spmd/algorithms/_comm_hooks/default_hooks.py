"""FSDP1's default communication hooks (torch's `algorithms._comm_hooks.default_hooks`): a hook takes its state
and the flat unsharded gradient, and for a sharded strategy the output shard it writes; it reduces and divides.

Layer: algorithms (over comm). The division is split in two, as torch's: by `gradient_predivide_factor` before the
sum and by `gradient_postdivide_factor` after it, their product the group's size, so large groups neither
overflow nor underflow a low-precision sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spmd.comm.collectives import all_reduce, reduce_scatter_tensor
from spmd.comm.world import AnyGroup, get_world_size

__all__ = ["DefaultState", "LowPrecisionState", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook",
           "reduce_scatter_hook"]


class DefaultState:
    """The group the hooks reduce over and the two division factors (torch's choice: the largest power of two
    at most the square root of the group's size, then the rest)."""

    def __init__(self, process_group: AnyGroup | None) -> None:
        self.process_group = process_group
        self.world_size = get_world_size(process_group)
        self.gradient_predivide_factor = self._get_gradient_predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor

    @staticmethod
    def _get_gradient_predivide_factor(world_size: int) -> float:
        factor = 1
        while world_size % factor == 0 and world_size / factor > factor:
            factor *= 2
        return float(factor)


class LowPrecisionState(DefaultState):
    """DefaultState for the compressing hooks: `parameter_type` is the dtype the reduced gradient goes back to."""

    def __init__(self, process_group: AnyGroup | None, parameter_type: torch.dtype = torch.float32) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: Tensor) -> None:
    """NO_SHARD's: average `grad` over the group in place."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    all_reduce(grad, group=state.process_group)
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: Tensor, output: Tensor) -> None:
    """The sharded strategies': this rank's shard of the group's average of `grad`, into `output`."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    reduce_scatter_tensor(output, grad, group=state.process_group)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _low_precision_hook(precision: torch.dtype, state: LowPrecisionState, grad: Tensor,
                        output: Tensor | None) -> None:
    """Reduce in `precision`: the tensors' data are cast to it, reduced, and cast back to the parameter type
    (the tensors themselves stay the caller's objects)."""
    if grad.dtype != precision:
        grad.data = grad.data.to(precision)
    if output is None:
        allreduce_hook(state, grad)
        grad.data = grad.data.to(state.parameter_type)
        return
    if output.dtype != precision:
        output.data = output.data.to(precision)
    reduce_scatter_hook(state, grad, output)
    output.data = output.data.to(state.parameter_type)


def fp16_compress_hook(state: LowPrecisionState, grad: Tensor, output: Tensor | None = None) -> None:
    """The average reduced in float16."""
    _low_precision_hook(torch.float16, state, grad, output)


def bf16_compress_hook(state: LowPrecisionState, grad: Tensor, output: Tensor | None = None) -> None:
    """The average reduced in bfloat16."""
    _low_precision_hook(torch.bfloat16, state, grad, output)
