"""Out-of-place collectives, and the autograd-aware ones in adjoint pairs, for the layers above comm.

Layer: comm. Two kinds:
- Plain out-of-place collectives (`all_reduced`, `all_gathered`, `reduce_scattered`, `all_to_all_dims`): return a
  new tensor and never touch their input. They gather/scatter along any tensor dim and accept uneven
  (torch.chunk-sized) pieces. Autograd does not see through them: DTensor's redistribute uses them below its
  own autograd functions. A wrapper subclass input (a quantized weight) travels as a plain copy of its value,
  so the result is a plain tensor.
- Autograd-aware collectives, defined in adjoint pairs side by side (STYLE rule 4). Each is named by what it
  does forward and backward, and its docstring names its adjoint. Each backward applies its adjoint as an
  autograd function, so a backward with create_graph=True can be differentiated again (Hessian-vector
  products). tests/comm/test_functional.py states which gradient each rank receives.
Every function here is collective over `group`: all its ranks call it, in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spmd.comm import torch_backend
from spmd.comm.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    holds_fewer_bytes,
    is_wrapper_subclass,
    reduce_scatter_tensor,
)
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp


def _pad_dim(tensor: Tensor, dim: int, size: int) -> Tensor:
    """`tensor` zero-padded at the end of `dim` to `size` (no copy when already that size)."""
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)


def _plain(tensor: Tensor) -> Tensor:
    """`tensor`, or for a wrapper subclass (a DTensor's quantized local tensor, say) a plain copy of its value made
    by its own copy_, which the transports can move."""
    if not is_wrapper_subclass(tensor):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _even_sizes(tensor: Tensor, dim: int, group: ProcessGroup) -> list[int]:
    return [tensor.shape[dim]] * group.size()


# -- plain out-of-place collectives -------------------------------------------------------------------------

def all_reduced(tensor: Tensor, op: ReduceOp, group: ProcessGroup) -> Tensor:
    """A new tensor holding the reduction of `tensor` over the group."""
    out = _plain(tensor)
    out = out.clone(memory_format=torch.contiguous_format) if out is tensor else out
    all_reduce(out, op, group=group)
    return out


def all_gathered(tensor: Tensor, dim: int, group: ProcessGroup, sizes: list[int] | None = None) -> Tensor:
    """Every rank's `tensor` concatenated along `dim` in rank order. `sizes[r]` is rank r's extent of `dim`
    (default: all equal to this rank's); uneven pieces are padded to the largest for the collective. A compressed
    tensor subclass gathered whole along dim 0 gathers as itself where it can (torch_backend.subclass_all_gathered);
    any other subclass as a plain copy of its values."""
    if holds_fewer_bytes(tensor) and dim == 0 and (sizes is None or all(size == sizes[0] for size in sizes)):
        whole = torch_backend.subclass_all_gathered(tensor, group)
        if whole is not None:
            return whole
    tensor = _plain(tensor)
    sizes = sizes if sizes is not None else _even_sizes(tensor, dim, group)
    block = max(sizes)
    send = _pad_dim(tensor, dim, block).movedim(dim, 0).contiguous()
    out = send.new_empty((block * group.size(), *send.shape[1:]))
    all_gather_into_tensor(out, send, group=group)
    if any(size != block for size in sizes):
        out = torch.cat([out.narrow(0, r * block, size) for r, size in enumerate(sizes)], dim=0)
    return out.movedim(0, dim).contiguous()


def reduce_scattered(tensor: Tensor, op: ReduceOp, dim: int, group: ProcessGroup) -> Tensor:
    """This rank's torch.chunk piece along `dim` of the reduction of `tensor` over the group (uneven allowed)."""
    tensor = _plain(tensor)
    n = group.size()
    extent = tensor.shape[dim]
    block = -(-extent // n)
    send = _pad_dim(tensor, dim, block * n).movedim(dim, 0).contiguous()
    out = send.new_empty((block, *send.shape[1:]))
    reduce_scatter_tensor(out, send, op, group=group)
    mine = min(block, max(0, extent - block * group.rank()))
    return out.narrow(0, 0, mine).movedim(0, dim).contiguous()


def all_to_all_dims(tensor: Tensor, split_dim: int, cat_dim: int, group: ProcessGroup,
                    split_sizes: list[int], cat_sizes: list[int]) -> Tensor:
    """Split `tensor` along `split_dim` into pieces of `split_sizes` (piece r goes to rank r), and concatenate
    the pieces received along `cat_dim` in rank order; rank r's piece has extent `cat_sizes[r]` on `cat_dim`.

    Shard(cat_dim) -> Shard(split_dim) on a 1-d group in one collective. Self-adjoint (with the dims swapped).
    """
    tensor = _plain(tensor)
    pieces = [piece.contiguous().reshape(-1) for piece in tensor.split(split_sizes, dim=split_dim)]
    send = torch.cat(pieces) if pieces else tensor.new_empty(0)
    my_split = split_sizes[group.rank()]
    piece_shapes = []
    for size in cat_sizes:
        shape = list(tensor.shape)
        shape[split_dim] = my_split
        shape[cat_dim] = size
        piece_shapes.append(shape)
    recv_numels = [int(torch.Size(shape).numel()) for shape in piece_shapes]
    out = send.new_empty(sum(recv_numels))
    all_to_all_single(out, send, recv_numels, [p.numel() for p in pieces], group=group)
    received = [chunk.view(shape) for chunk, shape in zip(out.split(recv_numels), piece_shapes)]
    return torch.cat(received, dim=cat_dim)


# -- autograd-aware adjoint pairs ---------------------------------------------------------------------------

class _AllReduceFwdIdentityBwd(torch.autograd.Function):
    """Forward y = all-reduce-sum(x); backward dx = dy. Adjoint of _IdentityFwdAllReduceBwd.

    Placed where row-sharded partial sums leave a tensor-parallel region.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return all_reduced(x, ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, None]:
        return _IdentityFwdAllReduceBwd.apply(grad_y, ctx.group), None


class _IdentityFwdAllReduceBwd(torch.autograd.Function):
    """Forward y = x; backward dx = all-reduce-sum(dy). Adjoint of _AllReduceFwdIdentityBwd.

    Placed where a replicated activation enters a column-sharded matmul.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, None]:
        return _AllReduceFwdIdentityBwd.apply(grad_y, ctx.group), None


class _AllGatherFwdReduceScatterBwd(torch.autograd.Function):
    """Forward y = all-gather(x) along `dim` (equal pieces); backward dx = reduce-scatter-sum(dy) along `dim`.
    Adjoint of _ReduceScatterFwdAllGatherBwd."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gathered(x, dim, group)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, None, None]:
        return _ReduceScatterFwdAllGatherBwd.apply(grad_y, ctx.dim, ctx.group), None, None


class _ReduceScatterFwdAllGatherBwd(torch.autograd.Function):
    """Forward y = reduce-scatter-sum(x) along `dim` (extent divisible by the group size); backward
    dx = all-gather(dy) along `dim`. Adjoint of _AllGatherFwdReduceScatterBwd."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        if x.shape[dim] % group.size():
            raise ValueError(f"reduce_scatter_fwd_all_gather_bwd on rank {group.global_rank} of "
                             f"{group.description}: dim {dim} of shape {tuple(x.shape)} does not divide into "
                             f"{group.size()} equal pieces")
        ctx.dim, ctx.group = dim, group
        return reduce_scattered(x, ReduceOp.SUM, dim, group)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor, None, None]:
        return _AllGatherFwdReduceScatterBwd.apply(grad_y, ctx.dim, ctx.group), None, None


def all_reduce_fwd_identity_bwd(x: Tensor, group: ProcessGroup) -> Tensor:
    """y = sum of x over the group; the gradient passes through unchanged. Adjoint: identity_fwd_all_reduce_bwd."""
    return _AllReduceFwdIdentityBwd.apply(x, group)


def identity_fwd_all_reduce_bwd(x: Tensor, group: ProcessGroup) -> Tensor:
    """y = x; the gradient is summed over the group. Adjoint: all_reduce_fwd_identity_bwd."""
    return _IdentityFwdAllReduceBwd.apply(x, group)


def all_gather_fwd_reduce_scatter_bwd(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    """y = x gathered along `dim`; dx = dy reduce-scattered. Adjoint: reduce_scatter_fwd_all_gather_bwd."""
    return _AllGatherFwdReduceScatterBwd.apply(x, dim, group)


def reduce_scatter_fwd_all_gather_bwd(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    """y = this rank's piece of sum(x) along `dim`; dx = dy gathered. Adjoint: all_gather_fwd_reduce_scatter_bwd."""
    return _ReduceScatterFwdAllGatherBwd.apply(x, dim, group)

