"""Context parallelism of flex_attention (torch's `_ContextParallel.AttentionType.FLEX`): each rank keeps its
slice of the queries, gathers the keys and values of the whole sequence (`flex_cp_allgather`, whose backward
reduce-scatters their gradients) and attends with a BlockMask made for its slice (`_create_cp_block_mask`),
whose mask_mod is asked about the positions the rows had before the load balancer dealt them.

Layer: tensor.parallel. Unlike SDPA's ring, no DTensor is involved: flex_attention runs on plain tensors,
so its kernels and options work unchanged. As in torch, a score_mod is asked about this rank's query rows
(q_idx counts from the slice's first row, in the dealt order); a position-dependent score_mod needs the
global position, which the mask_mod gets. On the threads transport run differentiated eager flex_attention
(what CPU runs) one rank per process instead: it traces its score_mod with torch.fx, whose tracer patches
torch.nn.Module for every thread of the process.

Note (the protocol): every rank of the context-parallel mesh runs the same attention modules in the same order;
each call is one all-gather of keys and values forward (one collective when they have the same shape and
dtype) and one reduce-scatter of their gradients backward. Each rank's block mask must come from the same
mask_mod, sizes and load balancer as its peers' (`_context_parallel_shard` makes them so), or the ranks would
attend to different sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask, create_block_mask

from spmd.comm.functional import all_gathered, reduce_scattered
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.device_mesh import DeviceMesh, group_of
from spmd.tensor.api import DTensor
from spmd.tensor.experimental.load_balancer import _default_load_balancer, _LoadBalancer

__all__ = ["_create_cp_block_mask", "flex_cp_allgather"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_compiled_create_block_mask: Callable[..., BlockMask] | None = None


class _GatherKeysValues(torch.autograd.Function):
    """Forward: keys and values gathered along `seq_dim` over `group` (stacked into one collective when they
    match); backward: their gradients summed and scattered back, each rank getting its slice's."""

    @staticmethod
    def forward(ctx: Any, key: Tensor, value: Tensor, seq_dim: int, group: ProcessGroup) -> tuple[Tensor, Tensor]:
        ctx.seq_dim, ctx.group = seq_dim, group
        ctx.stacked = key.shape == value.shape and key.dtype == value.dtype
        if ctx.stacked:
            gathered = all_gathered(torch.stack([key, value]), seq_dim + 1, group).unbind(0)
        else:
            gathered = all_gathered(key.contiguous(), seq_dim, group), all_gathered(value.contiguous(), seq_dim, group)
        ctx.output_meta = [(g.shape, g.dtype, g.device) for g in gathered]
        return tuple(gathered)

    @staticmethod
    def backward(ctx: Any, grad_key: Tensor | None, grad_value: Tensor | None) -> tuple[Tensor, Tensor, None, None]:
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip((grad_key, grad_value), ctx.output_meta, strict=True)]
        if ctx.stacked:
            key, value = reduce_scattered(torch.stack(grads), ReduceOp.SUM, ctx.seq_dim + 1, ctx.group).unbind(0)
            return key, value, None, None
        key, value = (reduce_scattered(g.contiguous(), ReduceOp.SUM, ctx.seq_dim, ctx.group) for g in grads)
        return key, value, None, None


def flex_cp_allgather(k: Tensor, v: Tensor, seq_dim: int,
                      pg_name: ProcessGroup | DeviceMesh | tuple[DeviceMesh, int] | str) -> tuple[Tensor, Tensor]:
    """The whole sequence's keys and values from this rank's slices `k` and `v` (sliced along `seq_dim`, rank
    by rank, over the group `pg_name` names); differentiable: each rank's gradient is its slice of the sum."""
    group = group_of(pg_name, "spmd flex_cp_allgather")
    seq_dim = seq_dim % k.dim()
    if k.shape[:seq_dim] != v.shape[:seq_dim] or k.shape[seq_dim] != v.shape[seq_dim]:
        raise ValueError(f"spmd: flex_cp_allgather on rank {group.global_rank}: keys {tuple(k.shape)} and values "
                         f"{tuple(v.shape)} differ up to the sequence (dim {seq_dim})")
    return _GatherKeysValues.apply(k, v, seq_dim, group)


def _block_mask_maker(device_type: str) -> Callable[..., BlockMask]:
    """create_block_mask compiled once (as torch does: eager it builds the whole L x L mask) on accelerators;
    on CPU the eager one, whose dense mask is small at CPU sequence lengths and costs no compiler."""
    global _compiled_create_block_mask
    if device_type in ("cpu", "meta"):
        return create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False, fullgraph=True)
    return _compiled_create_block_mask


def _create_cp_block_mask(mask_mod: MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int,
                          device_mesh: DeviceMesh, load_balancer: _LoadBalancer | None = None, *,
                          BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_SPARSE_BLOCK_SIZE) -> BlockMask:
    """The BlockMask this rank's slice of the (dealt) queries attends to the whole (dealt) keys with: `mask_mod`
    over the global Q_LEN x KV_LEN, asked about each pair's positions before `load_balancer`'s deal (by default
    the head-tail deal when cp_options.enable_load_balance is set, as in torch). Unlike torch's, the slice need
    not be a whole number of blocks."""
    if device_mesh.ndim != 1:
        raise ValueError(f"spmd: _create_cp_block_mask takes the 1-D context-parallel mesh; got {device_mesh.ndim}-D"
                         f" {device_mesh.shape}")
    rank, size = device_mesh.get_local_rank(), device_mesh.size()
    if Q_LEN % size:
        raise ValueError(f"spmd: _create_cp_block_mask: a query sequence of {Q_LEN} does not divide over {size} "
                         f"ranks")
    balancer = load_balancer if load_balancer is not None else _default_load_balancer(Q_LEN, size,
                                                                                     device_mesh.device_type)
    indices = None if balancer is None else balancer._generate_indices(restore=False)
    if indices is not None:
        if Q_LEN != KV_LEN or indices.shape[1] != Q_LEN:
            raise ValueError(f"spmd: _create_cp_block_mask: a load balancer deals one sequence to queries and keys "
                             f"alike; got Q_LEN={Q_LEN}, KV_LEN={KV_LEN} and indices for {indices.shape[1]}")
        if indices.shape[0] != 1 and B not in (1, indices.shape[0]):
            raise ValueError(f"spmd: _create_cp_block_mask: the load balancer deals {indices.shape[0]} batch rows "
                             f"differently but the mask has B={B}")
        B = max(B, indices.shape[0])   # a deal per batch row needs a mask per row
        indices = indices.to(device_mesh.device_type)
    local_len = Q_LEN // size
    first = rank * local_len

    def local_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if indices is None:
            return mask_mod(b, h, q_idx + first, kv_idx)
        row = indices[0] if indices.shape[0] == 1 else indices[b]
        return mask_mod(b, h, row[q_idx + first], row[kv_idx])

    return _block_mask_maker(device_mesh.device_type)(local_mask_mod, B, H, local_len, KV_LEN,
                                                      device=device_mesh.device_type, BLOCK_SIZE=BLOCK_SIZE)


def shard_block_mask(block_mask: BlockMask, mesh: DeviceMesh, load_balancer: _LoadBalancer | None) -> BlockMask:
    """`_context_parallel_shard`'s slice of a BlockMask: the mask of this rank's queries against all keys."""
    return _create_cp_block_mask(block_mask.mask_mod, block_mask.kv_num_blocks.shape[0],
                                 block_mask.kv_num_blocks.shape[1], block_mask.seq_lengths[0],
                                 block_mask.seq_lengths[1], mesh, load_balancer, BLOCK_SIZE=block_mask.BLOCK_SIZE)


_QKV = ("query", "key", "value")


def gather_flex_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], seq_dim: int,
                       mesh: DeviceMesh) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A flex attention module's arguments with its key and value (second and third, positional or named as
    flex_attention names them) gathered over `mesh` along `seq_dim`; the query and the rest unchanged."""
    args, kwargs = list(args), dict(kwargs)
    found = [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(_QKV)]
    if not all(isinstance(t, Tensor) for t in found):
        raise TypeError(f"spmd: _ContextParallel(FLEX) on mesh rank {mesh.get_local_rank()}: the attention module "
                        f"must take query, key and value tensors first (as flex_attention does); got "
                        f"{[type(t).__name__ for t in found]}")
    if any(isinstance(t, DTensor) for t in found):
        raise TypeError("spmd: _ContextParallel(FLEX) gathers plain tensors (this rank's slices); got a DTensor")
    key, value = flex_cp_allgather(found[1], found[2], seq_dim, mesh.get_group())
    for i, gathered in ((1, key), (2, value)):
        if i < len(args):
            args[i] = gathered
        else:
            kwargs[_QKV[i]] = gathered
    return tuple(args), kwargs
