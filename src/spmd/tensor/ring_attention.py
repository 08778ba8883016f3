"""Ring attention: scaled dot-product attention of this rank's slice of a sequence against every rank's slice,
one key/value block at a time, the blocks' results merged by their log-sum-exp, forward and backward.

Layer: tensor. The engine of context parallelism (tensor.experimental.context_parallel and the DTensor rules of
ops.attention): it works on local tensors over a ProcessGroup. A rank never holds more than its own block and
the one in flight, so the memory of attention stays that of the local slice; the gathered variant ("allgather")
fetches every block at once instead, one collective for many.

Note (the ring protocol)
Every rank of the group calls with its own query, key and value blocks, all of the same shapes, and the same
is_causal, scale, layout and method, as for any collective. Step i (0 <= i < n) attends this rank's queries to
the block of rank (rank - i) mod n:
- "alltoall" (torch's name; a ring pass): at the start of step i < n - 1 each rank sends the block it holds to
  rank + 1 and receives the next from rank - 1, so the transfer overlaps step i's attention. Backward sends
  the key/value blocks the same way, and beside them a gradient accumulator that travels with its block: rank
  r adds its contribution to the block it holds, then passes the sum on; after n steps each accumulator has
  visited every rank and arrives home. Two P2P tags keep the two streams apart.
- "allgather": one all-gather of every block forward (and again backward, rather than keeping n blocks alive
  until then); backward computes every block's gradient contribution and one reduce-scatter sums them home.
The flash-attention identity makes the blocks independent: a block's output is merged into the running one by
the log-sum-exps, and backward needs only the final output and log-sum-exp to compute each block's gradients.

Which keys a query block sees (is_causal): with the plain layout (rank r holds the r-th slice) the block of
rank r itself is causal, earlier ranks' blocks are fully visible and later ones invisible. With the head-tail
layout (rank r holds chunks r and 2n-1-r of 2n, torch's load balance) the own block is causal over the
concatenated chunks, an earlier rank's block is visible to every query through its first chunk only, and a
later rank's block is fully visible to the queries of the second chunk only: every rank does the same work.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor

from spmd._core.errors import CommError
from spmd.comm.functional import all_gathered, reduce_scattered
from spmd.comm.group import ProcessGroup
from spmd.comm.p2p import P2POp, batch_isend_irecv, irecv, isend
from spmd.comm.reduce_op import ReduceOp

__all__ = ["ContextParallelOptions", "RotateMethod", "Visibility", "cp_options", "ring_attention",
           "ring_attention_backward", "ring_attention_forward", "visibility"]

aten = torch.ops.aten

_KV_TAG = 0x43504B56      # the key/value blocks of the ring ("CPKV")
_GRAD_TAG = 0x43504447    # the travelling gradient accumulators ("CPDG")


class RotateMethod(enum.Enum):
    """How the key/value blocks reach every rank (torch's names)."""

    ALL_GATHER = "allgather"    # one all-gather of every block: fewest messages, n blocks in memory
    ALL_TO_ALL = "alltoall"     # a ring pass, one block per step overlapped with the attention: one block more


@dataclasses.dataclass
class ContextParallelOptions:
    """Process-wide options of context parallelism (torch's `_cp_options`): whether causal sequences are dealt
    out head-tail, how blocks travel, and whether block results are merged in float32 (for 16-bit inputs)."""

    enable_load_balance: bool = True
    rotate_method: RotateMethod = RotateMethod.ALL_GATHER
    convert_to_f32: bool = True


cp_options = ContextParallelOptions()


class Visibility(enum.Enum):
    """Which part of a key/value block this rank's queries attend to."""

    NONE = "none"                     # plain causal layout, a later rank's block
    CAUSAL = "causal"                 # the own block: causal over the local positions
    FULL = "full"                     # every query, every key
    FIRST_KEYS = "first keys"         # head-tail, an earlier rank's block: every query, the block's first chunk
    LAST_QUERIES = "last queries"     # head-tail, a later rank's block: the second query chunk, every key


def visibility(rank: int, source: int, is_causal: bool, head_tail: bool) -> Visibility:
    """What rank `rank`'s queries see of rank `source`'s keys (see the module docstring)."""
    if not is_causal:
        return Visibility.FULL
    if source == rank:
        return Visibility.CAUSAL
    if head_tail:
        return Visibility.FIRST_KEYS if source < rank else Visibility.LAST_QUERIES
    return Visibility.FULL if source < rank else Visibility.NONE


# -- block kernels ----------------------------------------------------------------------------------------

class BlockKernels(Protocol):
    """Attention of one query block to one key/value block, returning the log-sum-exp; and its backward given
    the FINAL (merged) output and log-sum-exp."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, causal: bool,
                scale: float | None) -> tuple[Tensor, Tensor]: ...

    def backward(self, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]: ...


def _expand_heads(query: Tensor, tensor: Tensor) -> Tensor:
    """Grouped key/value heads repeated to the query's head count (kernels without grouped-query support)."""
    groups = query.shape[-3] // tensor.shape[-3]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def _sum_heads(grad: Tensor, heads: int) -> Tensor:
    """The gradient of `_expand_heads`: each group of repeated heads summed back into its key/value head."""
    groups = grad.shape[-3] // heads
    if groups == 1:
        return grad
    return grad.unflatten(-3, (heads, groups)).sum(-3)


class _CpuFlash:
    """torch's CPU flash-attention kernels (grouped-query heads served by the kernel itself)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, causal: bool,
                scale: float | None) -> tuple[Tensor, Tensor]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse.contiguous(), 0.0, causal, scale=scale)


class _CudaEfficient:
    """torch's memory-efficient CUDA kernels (every float dtype). Their log-sum-exp is padded to a multiple of
    32 query rows (not on ROCm); dropout is off, so the random-state tensors are never read."""

    @staticmethod
    def _lse_width(rows: int) -> int:
        return rows if torch.version.hip else math.ceil(rows / 32) * 32

    def forward(self, query: Tensor, key: Tensor, value: Tensor, causal: bool,
                scale: float | None) -> tuple[Tensor, Tensor]:
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            query, _expand_heads(query, key), _expand_heads(query, value), None, True, 0.0, causal, scale=scale)
        return out, lse[..., :query.shape[-2]]

    def backward(self, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
        rows = query.shape[-2]
        padded = torch.nn.functional.pad(lse.float(), (0, self._lse_width(rows) - rows)).contiguous()
        unused = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out.contiguous(), query, _expand_heads(query, key), _expand_heads(query, value), None, out,
            padded, unused, unused, 0.0, [True, True, True, False], causal, scale=scale)
        heads = key.shape[-3]
        return dq, _sum_heads(dk, heads), _sum_heads(dv, heads)


class _Math:
    """Attention written out in tensor ops, for any device: scores of one block pair at a time."""

    @staticmethod
    def _scores(query: Tensor, key: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, float]:
        factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        scores = (query @ key.transpose(-2, -1)) * factor
        if causal:
            rows, cols = scores.shape[-2:]
            hidden = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(hidden, float("-inf"))
        return scores, factor

    def forward(self, query: Tensor, key: Tensor, value: Tensor, causal: bool,
                scale: float | None) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(query.dtype, torch.float32)
        scores, _ = self._scores(query.to(acc), _expand_heads(query, key).to(acc), causal, scale)
        lse = scores.logsumexp(-1)
        out = (scores - lse.unsqueeze(-1)).exp() @ _expand_heads(query, value).to(acc)
        return out.to(query.dtype), lse

    def backward(self, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
        acc = torch.promote_types(query.dtype, torch.float32)
        q, k, v = query.to(acc), _expand_heads(query, key).to(acc), _expand_heads(query, value).to(acc)
        d_out, o = grad_out.to(acc), out.to(acc)
        scores, factor = self._scores(q, k, causal, scale)
        probs = (scores - lse.to(acc).unsqueeze(-1)).exp()
        dv = probs.transpose(-2, -1) @ d_out
        d_scores = probs * (d_out @ v.transpose(-2, -1) - (d_out * o).sum(-1, keepdim=True))
        dq = (d_scores @ k) * factor
        dk = (d_scores.transpose(-2, -1) @ q) * factor
        heads = key.shape[-3]
        return (dq.to(query.dtype), _sum_heads(dk, heads).to(key.dtype), _sum_heads(dv, heads).to(value.dtype))


_KERNELS: dict[str, BlockKernels] = {"cpu": _CpuFlash(), "cuda": _CudaEfficient()}
MATH_KERNELS: BlockKernels = _Math()


def kernels_for(device: torch.device) -> BlockKernels:
    """The fused kernels of `device`'s type where torch has them, else attention in tensor ops."""
    return _KERNELS.get(device.type, MATH_KERNELS)


# -- moving blocks ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Packing of a key and a value block into one flat buffer (one message per step), and back."""

    key_shape: torch.Size
    value_shape: torch.Size

    def pack(self, key: Tensor, value: Tensor) -> Tensor:
        return torch.cat([key.reshape(-1), value.reshape(-1)])

    def unpack(self, packed: Tensor) -> tuple[Tensor, Tensor]:
        split = math.prod(self.key_shape)
        return packed[:split].view(self.key_shape), packed[split:].view(self.value_shape)


def _shift(group: ProcessGroup, buffer: Tensor, tag: int) -> Callable[[], Tensor]:
    """Start sending `buffer` to the next rank of the ring and receiving the previous rank's; returns the wait
    for what arrives (a failure notes which ring it was)."""
    rank, size = group.rank(), group.size()
    received = torch.empty_like(buffer)
    works = batch_isend_irecv([P2POp(isend, buffer, group=group, tag=tag, group_peer=(rank + 1) % size),
                               P2POp(irecv, received, group=group, tag=tag, group_peer=(rank - 1) % size)])

    def wait() -> Tensor:
        try:
            for work in works:
                work.wait(timeout=group.timeout)
        except CommError as error:
            what = "key/value block" if tag == _KV_TAG else "key/value gradient"
            error.add_note(f"spmd ring attention: group rank {rank} was passing a {what} to group rank "
                           f"{(rank + 1) % size} and waiting for one from group rank {(rank - 1) % size}; every "
                           f"rank of the group must run the same attention calls")
            raise
        return received
    return wait


def _ring_blocks(group: ProcessGroup, packed: Tensor) -> Iterator[tuple[int, Tensor]]:
    """(source rank, its packed block) for steps 0..n-1, each next block in flight while the caller works."""
    rank, size = group.rank(), group.size()
    current = packed
    for step in range(size):
        pending = _shift(group, current, _KV_TAG) if step < size - 1 else None
        yield (rank - step) % size, current
        if pending is not None:
            current = pending()


def _gathered_blocks(group: ProcessGroup, packed: Tensor) -> Iterator[tuple[int, Tensor]]:
    """(source rank, its packed block) in the ring's order, from one all-gather."""
    rank, size = group.rank(), group.size()
    everyone = all_gathered(packed, 0, group).chunk(size)
    for step in range(size):
        source = (rank - step) % size
        yield source, everyone[source]


def _blocks(group: ProcessGroup, packed: Tensor, method: RotateMethod) -> Iterator[tuple[int, Tensor]]:
    return (_ring_blocks if method is RotateMethod.ALL_TO_ALL else _gathered_blocks)(group, packed)


# -- forward and backward ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RingLayout:
    """How the sequence lies on the group's ranks, and what the call asks for."""

    group: ProcessGroup
    is_causal: bool
    head_tail: bool
    scale: float | None
    method: RotateMethod

    def check(self, query: Tensor, key: Tensor, value: Tensor, where: str) -> None:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"{where}: ring attention takes (batch, heads, sequence, dim) tensors; got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if key.shape[:-1] != value.shape[:-1] or query.shape[-2] != key.shape[-2]:
            raise ValueError(f"{where}: query, key and value must hold the same slice of one sequence (dim 2); "
                             f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if query.shape[-3] % key.shape[-3]:
            raise ValueError(f"{where}: {query.shape[-3]} query heads do not group over {key.shape[-3]} "
                             f"key/value heads")
        if self.is_causal and self.head_tail and query.shape[-2] % 2:
            raise ValueError(f"{where}: the head-tail layout holds two equal chunks per rank, but this rank's "
                             f"slice has {query.shape[-2]} positions")


def _rows(part: Visibility, length: int) -> slice:
    return slice(length // 2, length) if part is Visibility.LAST_QUERIES else slice(0, length)


def _cols(part: Visibility, length: int) -> slice:
    return slice(0, length // 2) if part is Visibility.FIRST_KEYS else slice(0, length)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if cp_options.convert_to_f32 else dtype


def ring_attention_forward(layout: RingLayout, query: Tensor, key: Tensor,
                           value: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's attention output over the whole sequence and its log-sum-exp (B, H, L)."""
    kernels = kernels_for(query.device)
    blocks = _Blocks(key.shape, value.shape)
    rank, length = layout.group.rank(), query.shape[-2]
    acc = _accumulation_dtype(query.dtype)
    out: Tensor | None = None
    lse: Tensor | None = None
    for source, packed in _blocks(layout.group, blocks.pack(key, value), layout.method):
        part = visibility(rank, source, layout.is_causal, layout.head_tail)
        if part is Visibility.NONE:
            continue
        k, v = blocks.unpack(packed)
        rows, cols = _rows(part, length), _cols(part, length)
        block_out, block_lse = kernels.forward(query[..., rows, :], k[..., cols, :], v[..., cols, :],
                                               part is Visibility.CAUSAL, layout.scale)
        block_out, block_lse = block_out.to(acc), block_lse.to(acc)
        if out is None or lse is None:      # step 0, the own block: every row
            out, lse = block_out, block_lse
            continue
        merged = torch.logaddexp(lse[..., rows], block_lse)
        out[..., rows, :] = (out[..., rows, :] * (lse[..., rows] - merged).exp().unsqueeze(-1)
                             + block_out * (block_lse - merged).exp().unsqueeze(-1))
        lse[..., rows] = merged
    assert out is not None and lse is not None
    return out.to(query.dtype), lse.to(torch.promote_types(query.dtype, torch.float32))


def ring_attention_backward(layout: RingLayout, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                            out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of this rank's query, key and value blocks, from the output gradient of its queries and
    the final output and log-sum-exp of `ring_attention_forward`."""
    kernels = kernels_for(query.device)
    blocks = _Blocks(key.shape, value.shape)
    group, rank, size, length = layout.group, layout.group.rank(), layout.group.size(), query.shape[-2]
    acc = _accumulation_dtype(query.dtype)
    grad_query = torch.zeros(query.shape, dtype=acc, device=query.device)
    contributions: list[Tensor | None] = [None] * size       # allgather: per source, this rank's dk/dv
    travelling: Callable[[], Tensor] | None = None            # alltoall: the accumulator arriving from rank - 1
    for step, (source, packed) in enumerate(_blocks(group, blocks.pack(key, value), layout.method)):
        part = visibility(rank, source, layout.is_causal, layout.head_tail)
        grad_key = torch.zeros(key.shape, dtype=acc, device=key.device)
        grad_value = torch.zeros(value.shape, dtype=acc, device=value.device)
        if part is not Visibility.NONE:
            k, v = blocks.unpack(packed)
            rows, cols = _rows(part, length), _cols(part, length)
            dq, dk, dv = kernels.backward(grad_out[..., rows, :], query[..., rows, :], k[..., cols, :],
                                          v[..., cols, :], out[..., rows, :], lse[..., rows],
                                          part is Visibility.CAUSAL, layout.scale)
            grad_query[..., rows, :] += dq
            grad_key[..., cols, :] += dk
            grad_value[..., cols, :] += dv
        mine = blocks.pack(grad_key, grad_value)
        if layout.method is RotateMethod.ALL_GATHER:
            contributions[source] = mine
            continue
        if step > 0:
            assert travelling is not None
            mine += travelling()
        travelling = _shift(group, mine, _GRAD_TAG)
    if layout.method is RotateMethod.ALL_GATHER:
        home = reduce_scattered(torch.cat(contributions), ReduceOp.SUM, 0, group)
    else:
        assert travelling is not None
        home = travelling()
    grad_key, grad_value = blocks.unpack(home)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention on local tensors, for autograd: saves only this rank's blocks, output and log-sum-exp."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, layout: RingLayout) -> Tensor:  # type: ignore[override]
        out, lse = ring_attention_forward(layout, query, key, value)
        ctx.layout = layout
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        grads = ring_attention_backward(ctx.layout, grad_out.contiguous(), query, key, value, out, lse)
        return (*grads, None)


def ring_attention(layout: RingLayout, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Differentiable ring attention of this rank's blocks (see the module's Note: collective over the group)."""
    return _RingAttention.apply(query, key, value, layout)
