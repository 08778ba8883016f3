"""spmd's out-of-place collectives as torch operators (`torch.ops.spmd.*`, torch.library custom ops), which
torch.compile puts in its graphs instead of breaking at, and torch.export records: the functional collectives
(spmd._functional_collectives) and the classic in-place ones (comm.collectives, synchronous calls) take this path
while they are traced (`tracing`).

Layer: comm. Each op names its group by name (the group, not its object, is what a graph can hold) and runs,
when the graph runs, the same collective as eager code (comm.functional), on the group of that name in the
calling rank's world. Each has a fake (shape-only) implementation for tracing, and the gather, scatter and
all-to-all ops their adjoints as autograd formulas, so compiled training differentiates through them. Like every
collective, a graph holding them must run on every rank of the group, in the same order.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor
from torch._guards import TracingContext

from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.world import group_named


def _named(group_name: str, op: str) -> ProcessGroup:
    return group_named(group_name, f"spmd::{op}")


def _eager() -> types.ModuleType:
    """comm.functional, whose out-of-place collectives run the ops: imported when one first runs, as it builds on
    comm.collectives, which builds on this module."""
    import spmd.comm.functional as functional

    return functional


def _in_place() -> types.ModuleType:
    """comm.collectives, whose in-place collectives run the all-to-all and broadcast ops (imported as _eager)."""
    import spmd.comm.collectives as collectives

    return collectives


def tracing(tensor: Tensor, async_op: bool = False) -> bool:
    """Whether a collective call on `tensor` is being traced, and so should be one of these ops (an async one
    keeps its Work and runs eagerly, a graph break): by dynamo (torch.compile, strict torch.export), or on this
    thread under a tracing context without it (non-strict torch.export, AOTAutograd), whose tensors are fake
    or functional, never plain (so an eager call on a plain tensor pays ~0.1 us, not the tracing context's
    lookup). Not torch.compiler.is_compiling(): that flag is a process global, true for the whole of a compile,
    so other rank threads' eager calls (and these ops' own implementations) would see it too."""
    if async_op:
        return False
    return torch.compiler.is_dynamo_compiling() or (type(tensor) is not Tensor and TracingContext.try_get() is not None)


def _with_dim(tensor: Tensor, dim: int, size: int) -> list[int]:
    shape = list(tensor.shape)
    shape[dim] = size
    return shape


@torch.library.custom_op("spmd::all_reduce", mutates_args=())
def all_reduce_op(input: Tensor, reduce_op: str, group_name: str) -> Tensor:
    """The reduction (`reduce_op`: a ReduceOp's value, "sum", "avg", ...) of `input` over the group."""
    return _eager().all_reduced(input, ReduceOp(reduce_op), _named(group_name, "all_reduce"))


@all_reduce_op.register_fake
def _(input: Tensor, reduce_op: str, group_name: str) -> Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op("spmd::all_gather", mutates_args=())
def all_gather_op(input: Tensor, gather_dim: int, group_size: int, group_name: str) -> Tensor:
    """Every rank's `input` concatenated along `gather_dim` in group-rank order (equal pieces)."""
    return _eager().all_gathered(input, gather_dim, _named(group_name, "all_gather"))


@all_gather_op.register_fake
def _(input: Tensor, gather_dim: int, group_size: int, group_name: str) -> Tensor:
    return input.new_empty(_with_dim(input, gather_dim, input.shape[gather_dim] * group_size))


@torch.library.custom_op("spmd::reduce_scatter", mutates_args=())
def reduce_scatter_op(input: Tensor, reduce_op: str, scatter_dim: int, group_size: int, group_name: str) -> Tensor:
    """This rank's block along `scatter_dim` (equal blocks) of the reduction of `input` over the group."""
    return _eager().reduce_scattered(input, ReduceOp(reduce_op), scatter_dim, _named(group_name, "reduce_scatter"))


@reduce_scatter_op.register_fake
def _(input: Tensor, reduce_op: str, scatter_dim: int, group_size: int, group_name: str) -> Tensor:
    return input.new_empty(_with_dim(input, scatter_dim, input.shape[scatter_dim] // group_size))


@torch.library.custom_op("spmd::all_to_all_single", mutates_args=())
def all_to_all_single_op(input: Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                         group_name: str) -> Tensor:
    """Block j of `input` along dim 0 (`input_split_sizes` rows, or equal blocks) to group rank j; the blocks
    received, in group-rank order (`output_split_sizes` rows each)."""
    rows = sum(output_split_sizes) if output_split_sizes is not None else input.shape[0]
    out = input.new_empty((rows, *input.shape[1:]))
    _in_place().all_to_all_single(out, input.contiguous(), output_split_sizes, input_split_sizes,
                                  group=_named(group_name, "all_to_all_single"))
    return out


@all_to_all_single_op.register_fake
def _(input: Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
      group_name: str) -> Tensor:
    rows = sum(output_split_sizes) if output_split_sizes is not None else input.shape[0]
    return input.new_empty((rows, *input.shape[1:]))


@torch.library.custom_op("spmd::broadcast", mutates_args=())
def broadcast_op(input: Tensor, group_src: int, group_name: str) -> Tensor:
    """Group rank `group_src`'s `input`, on every rank."""
    out = input.clone(memory_format=torch.contiguous_format)
    _in_place().broadcast(out, group_src=group_src, group=_named(group_name, "broadcast"))
    return out


@broadcast_op.register_fake
def _(input: Tensor, group_src: int, group_name: str) -> Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


# -- autograd: each gradient is the adjoint collective's (comm.functional's adjoint pairs) ------------------------

def _keep_arguments(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.arguments = inputs[1:]


def _all_gather_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    gather_dim, group_size, group_name = ctx.arguments
    scattered = reduce_scatter_op(grad.contiguous(), ReduceOp.SUM.value, gather_dim, group_size, group_name)
    return scattered, None, None, None


def _reduce_scatter_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    reduce_op, scatter_dim, group_size, group_name = ctx.arguments
    if reduce_op != ReduceOp.SUM.value:
        raise RuntimeError(f"spmd::reduce_scatter differentiates a sum only; got {reduce_op!r}")
    return all_gather_op(grad.contiguous(), scatter_dim, group_size, group_name), None, None, None, None


def _all_to_all_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    output_split_sizes, input_split_sizes, group_name = ctx.arguments
    return all_to_all_single_op(grad.contiguous(), input_split_sizes, output_split_sizes, group_name), None, None, None


all_gather_op.register_autograd(_all_gather_backward, setup_context=_keep_arguments)
reduce_scatter_op.register_autograd(_reduce_scatter_backward, setup_context=_keep_arguments)
all_to_all_single_op.register_autograd(_all_to_all_backward, setup_context=_keep_arguments)


# -- the classic in-place collectives, traced: each writes an op's result into its tensors --------------------------

def all_reduce_into(tensor: Tensor, op: ReduceOp, group: ProcessGroup) -> None:
    tensor.copy_(all_reduce_op(tensor, op.value, group.name))


def broadcast_into(tensor: Tensor, group_src: int, group: ProcessGroup) -> None:
    tensor.copy_(broadcast_op(tensor, group_src, group.name))


def all_gather_into(output: Tensor, input: Tensor, group: ProcessGroup) -> None:
    output.copy_(all_gather_op(input, 0, group.size(), group.name).view_as(output))


def all_gather_list_into(outputs: list[Tensor], input: Tensor, group: ProcessGroup) -> None:
    for output, piece in zip(outputs, all_gather_op(input.unsqueeze(0), 0, group.size(), group.name).unbind(0),
                             strict=True):
        output.copy_(piece)


def reduce_scatter_into(output: Tensor, input: Tensor, op: ReduceOp, group: ProcessGroup) -> None:
    output.copy_(reduce_scatter_op(input, op.value, 0, group.size(), group.name).view_as(output))


def all_to_all_into(output: Tensor, input: Tensor, output_split_sizes: list[int] | None,
                    input_split_sizes: list[int] | None, group: ProcessGroup) -> None:
    output.copy_(all_to_all_single_op(input, output_split_sizes, input_split_sizes, group.name))
