"""Collectives autograd differentiates, on spmd's groups: torch's `nn.functional` of its distributed package.

Layer: nn. Each returns new tensors (its inputs are left alone) and its backward runs the adjoint collective:
broadcast <-> reduce to the root, gather <-> scatter, all_gather <-> reduce_scatter (sum), all_to_all <-> the
reverse all_to_all, all_reduce <-> all_reduce. Reductions differentiate for SUM and AVG (an AVG's backward divides
by the group size); another op's backward is refused. Gradients of a rank that is not the root come out as zeros
where the collective ignored its input, as in torch. The contrastive-learning case:
`torch.cat(all_gather(embeddings))` lets every rank's loss reach every rank's embeddings. Every function is
collective over `group` (default: the world).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function

from spmd.comm import collectives as c
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.world import AnyGroup, resolve_group

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather", "reduce",
           "reduce_scatter", "scatter"]


def _pg(group: AnyGroup | None, op: str) -> ProcessGroup:
    return resolve_group(group, f"spmd.nn.functional.{op}")


class _Broadcast(Function):
    @staticmethod
    def forward(ctx: Any, src: int, group: ProcessGroup, tensor: Tensor) -> Tensor:
        ctx.src, ctx.group = src, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        c.broadcast(out, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:
        reduced = _Reduce.apply(ctx.src, ReduceOp.SUM, ctx.group, grad)
        return None, None, reduced if ctx.group.global_rank == ctx.src else reduced * 0


class _Reduce(Function):
    @staticmethod
    def forward(ctx: Any, dst: int, op: ReduceOp, group: ProcessGroup, tensor: Tensor) -> Tensor:
        ctx.dst, ctx.op, ctx.group = dst, op, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        c.reduce(out, dst=dst, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, Tensor]:
        return None, None, None, _Broadcast.apply(ctx.dst, ctx.group, grad) / _adjoint_divisor(ctx, "reduce")


class _Gather(Function):
    @staticmethod
    def forward(ctx: Any, dst: int, group: ProcessGroup, tensor: Tensor) -> tuple[Tensor, ...]:
        ctx.dst, ctx.group = dst, group
        pieces = [torch.zeros_like(tensor) for _ in range(group.size())]
        c.gather(tensor.contiguous(), pieces if group.global_rank == dst else None, dst=dst, group=group)
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, None, Tensor]:
        return None, None, _Scatter.apply(ctx.dst, ctx.group, *grads)


class _Scatter(Function):
    @staticmethod
    def forward(ctx: Any, src: int, group: ProcessGroup, *tensors: Tensor) -> Tensor:
        ctx.src, ctx.group = src, group
        out = torch.empty_like(tensors[group.group_rank], memory_format=torch.contiguous_format)
        c.scatter(out, [t.contiguous() for t in tensors] if group.global_rank == src else None, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        return (None, None, *_Gather.apply(ctx.src, ctx.group, grad))


class _AllGather(Function):
    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, tensor: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(group.size())]
        c.all_gather(pieces, tensor.contiguous(), group=group)
        return tuple(pieces)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, Tensor]:
        mine = torch.empty_like(grads[ctx.group.group_rank], memory_format=torch.contiguous_format)
        return None, _ReduceScatter.apply(ReduceOp.SUM, ctx.group, mine, *grads)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, group: ProcessGroup, output: Tensor, *inputs: Tensor) -> Tensor:
        ctx.op, ctx.group = op, group
        out = torch.empty_like(output, memory_format=torch.contiguous_format)
        c.reduce_scatter(out, [t.contiguous() for t in inputs], op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        divisor = _adjoint_divisor(ctx, "reduce_scatter")
        return (None, None, None, *(g / divisor for g in _AllGather.apply(ctx.group, grad)))


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, outputs: list[Tensor], *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        ctx.input_shapes = [t.shape for t in inputs]
        out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in outputs]
        c.all_to_all(out, [t.contiguous() for t in inputs], group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        shells = [grads[0].new_empty(shape) for shape in ctx.input_shapes]
        return (None, None, *_AllToAll.apply(ctx.group, shells, *grads))


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, output: Tensor, output_split_sizes: list[int] | None,
                input_split_sizes: list[int] | None, tensor: Tensor) -> Tensor:
        ctx.group, ctx.input_shape = group, tensor.shape
        ctx.output_split_sizes, ctx.input_split_sizes = input_split_sizes, output_split_sizes
        out = torch.empty_like(output, memory_format=torch.contiguous_format)
        c.all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        shell = grad.new_empty(ctx.input_shape)
        return None, None, None, None, _AllToAllSingle.apply(ctx.group, shell, ctx.output_split_sizes,
                                                             ctx.input_split_sizes, grad.contiguous())


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, group: ProcessGroup, tensor: Tensor) -> Tensor:
        ctx.op, ctx.group = op, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        c.all_reduce(out, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:
        _adjoint_divisor(ctx, "all_reduce")
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad)


def _adjoint_divisor(ctx: Any, name: str) -> int:
    """1 for a SUM, the group size for an AVG (each input counts 1/n); other ops have no collective adjoint."""
    if ctx.op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise RuntimeError(f"spmd.nn.functional.{name}: backward through {ctx.op} is not a collective (only SUM "
                           f"and AVG have one); reduce with SUM or AVG, or detach the result")
    return ctx.group.size() if ctx.op == ReduceOp.AVG else 1


def broadcast(tensor: Tensor, src: int, group: AnyGroup | None = None) -> Tensor:
    """`src`'s tensor on every rank; backward sums the gradients onto `src` (zeros elsewhere)."""
    return _Broadcast.apply(src, _pg(group, "broadcast"), tensor)


def gather(tensor: Tensor, dst: int = 0, group: AnyGroup | None = None) -> tuple[Tensor, ...]:
    """Every rank's tensor, on `dst` (zeros elsewhere); backward scatters `dst`'s gradients back."""
    return _Gather.apply(dst, _pg(group, "gather"), tensor)


def scatter(tensors: list[Tensor], src: int = 0, group: AnyGroup | None = None) -> Tensor:
    """tensors[rank] of `src`'s list on each rank; backward gathers the gradients onto `src`."""
    return _Scatter.apply(src, _pg(group, "scatter"), *tensors)


def reduce(tensor: Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None) -> Tensor:
    """The reduction on `dst` (other ranks get their input back); backward broadcasts `dst`'s gradient."""
    return _Reduce.apply(dst, op, _pg(group, "reduce"), tensor)


def reduce_scatter(output: Tensor, input_list: list[Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: AnyGroup | None = None) -> Tensor:
    """This rank's piece of the reduction of every rank's `input_list` (shaped as `output`, which is not
    written); backward all-gathers the gradients."""
    return _ReduceScatter.apply(op, _pg(group, "reduce_scatter"), output, *input_list)


def all_gather(tensor: Tensor, group: AnyGroup | None = None) -> tuple[Tensor, ...]:
    """Every rank's tensor, on every rank; backward sums each rank's gradients for this rank's tensor."""
    return _AllGather.apply(_pg(group, "all_gather"), tensor)


def all_to_all(output_tensor_list: list[Tensor], input_tensor_list: list[Tensor],
               group: AnyGroup | None = None) -> tuple[Tensor, ...]:
    """input_tensor_list[j] to rank j, shaped as output_tensor_list (not written); backward the reverse."""
    return _AllToAll.apply(_pg(group, "all_to_all"), output_tensor_list, *input_tensor_list)


def all_to_all_single(output: Tensor, input: Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: AnyGroup | None = None) -> Tensor:
    """all_to_all_single into a new tensor shaped as `output` (not written); backward swaps the splits."""
    return _AllToAllSingle.apply(_pg(group, "all_to_all_single"), output, output_split_sizes, input_split_sizes,
                                 input)


def all_reduce(tensor: Tensor, op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None) -> Tensor:
    """The reduction on every rank; backward all-reduces the gradient (SUM and AVG)."""
    return _AllReduce.apply(op, _pg(group, "all_reduce"), tensor)
