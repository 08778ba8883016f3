"""Context parallelism (torch's `context_parallel`): split a long sequence across the ranks of a mesh, each rank
holding a slice of every sequence-shaped buffer, while `scaled_dot_product_attention` still attends over the
whole sequence.

Layer: tensor. Inside the context, each call of `torch.nn.functional.scaled_dot_product_attention` on this rank
runs ring attention (tensor.ring_attention): this rank's queries attend to every rank's key/value block in turn,
the blocks fetched by one all-gather ("allgather", torch's default) or passed around the ring ("alltoall",
`set_rotate_method`), and merged by their log-sum-exps; every other op runs on the local slice, as it should
for a position-wise model. With a causal mask the sequence is dealt out head-tail (rank r holds chunks r and
2n-1-r of 2n), so each rank attends to about as many keys as every other, and each query chunk is computed
against only the keys it can see.

Note (the protocol): every rank of the mesh enters the context with the same buffers' shapes and calls the
attention the same number of times in the same order, as for any collective (tensor.ring_attention's Note says
what each call sends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from spmd.comm.functional import all_gathered
from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor
from spmd.tensor.experimental.load_balancer import _default_load_balancer, _LoadBalancer, rearrange
from spmd.tensor.ring_attention import (
    ContextParallelOptions,
    RingLayout,
    RotateMethod,
    cp_options,
    ring_attention,
)

__all__ = ["context_parallel", "context_parallel_unshard", "set_rotate_method"]


_RotateMethod = RotateMethod
_ContextParallelOptions = ContextParallelOptions
_cp_options = cp_options


def set_rotate_method(rotate_method: str) -> None:
    """Choose how key/value blocks travel between ranks: "allgather" (torch's default: one all-gather, every
    rank holds the whole sequence's keys for a moment) or "alltoall" (a ring pass, one block per step
    overlapped with the attention: memory of two blocks)."""
    methods = {method.value: method for method in RotateMethod}
    if rotate_method not in methods:
        raise NotImplementedError(f"spmd: context parallel rotate method {rotate_method!r} is not one of "
                                  f"{sorted(methods)}")
    cp_options.rotate_method = methods[rotate_method]


@dataclasses.dataclass(frozen=True)
class _Sharding:
    """What the attention needs to know on this rank: the mesh and whether the sequence was dealt head-tail."""

    mesh: DeviceMesh
    head_tail: bool


_active: ContextVar[_Sharding | None] = ContextVar("spmd_context_parallel", default=None)


def _cp_attention(original: Callable[..., Tensor], sharding: _Sharding, query: Tensor, key: Tensor,
                  value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """Ring attention of this rank's queries against the whole sequence's keys and values (`original`, torch's
    own function, is not needed: the blocks run on torch's fused kernels)."""
    rank = sharding.mesh.get_local_rank()
    where = f"spmd: context_parallel scaled_dot_product_attention on mesh rank {rank}"
    if any(isinstance(t, DTensor) for t in (query, key, value)):
        raise TypeError(f"{where}: takes local tensors (this rank's sequence slice), not DTensors")
    if attn_mask is not None:
        raise NotImplementedError(f"{where}: an explicit attn_mask is not served (it would have to be sharded "
                                  f"like the sequence); use is_causal=True")
    if dropout_p:
        raise NotImplementedError(f"{where}: dropout_p={dropout_p} is not served (attention runs block by "
                                  f"block); train with attention dropout 0, as long-context models do")
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"{where}: {query.shape[-3]} query heads and {key.shape[-3]} key/value heads need "
                         f"enable_gqa=True, as in torch")
    layout = RingLayout(sharding.mesh.get_group(), is_causal, sharding.head_tail, scale, cp_options.rotate_method)
    layout.check(query, key, value, where)
    return ring_attention(layout, query, key, value)


class _SdpaPatch:
    """`torch.nn.functional.scaled_dot_product_attention` replaced, while any rank of this process is inside
    a context, by a function that runs the context-parallel attention for a caller inside one and the original
    for everyone else.

    Note (which context a call belongs to): a thread that entered a context finds it through a ContextVar, so
    thread ranks each see their own. A thread that entered none (autograd's device threads, where activation
    checkpointing recomputes the forward) belongs to the process's only active context, if there is exactly
    one, as with one rank per process; otherwise it gets the original attention.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entered: list[tuple[int, _Sharding]] = []   # (thread ident, context), one per active entry
        self._original: Callable[..., Tensor] | None = None

    def _sharding(self) -> _Sharding | None:
        sharding = _active.get()
        if sharding is not None:
            return sharding
        entered = self._entered
        if len(entered) == 1 and entered[0][0] != threading.get_ident():
            return entered[0][1]
        return None

    def acquire(self, sharding: _Sharding) -> None:
        with self._lock:
            if not self._entered:
                original = F.scaled_dot_product_attention

                def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Tensor:
                    sharding = self._sharding()
                    if sharding is None:
                        return original(*args, **kwargs)
                    return _cp_attention(original, sharding, *args, **kwargs)

                scaled_dot_product_attention.__doc__ = original.__doc__
                self._original = original
                F.scaled_dot_product_attention = scaled_dot_product_attention
            self._entered = [*self._entered, (threading.get_ident(), sharding)]

    def release(self, sharding: _Sharding) -> None:
        with self._lock:
            entered = list(self._entered)
            entered.remove((threading.get_ident(), sharding))
            self._entered = entered
            if not entered:
                F.scaled_dot_product_attention = self._original
                self._original = None


_patch = _SdpaPatch()


def _check_buffers(buffers: list[Tensor], seq_dims: list[int], what: str) -> int:
    """The common sequence length of `buffers` along their `seq_dims`, after checking the arguments agree."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"spmd: {what}: {len(buffers)} buffers but {len(seq_dims)} sequence dims")
    lengths = {int(b.shape[d]) for b, d in zip(buffers, seq_dims, strict=True)}
    if len(lengths) > 1:
        raise ValueError(f"spmd: {what}: the buffers' sequence lengths differ ({sorted(lengths)}); they must "
                         f"be slices of one sequence")
    return lengths.pop() if lengths else 0


@contextlib.contextmanager
def context_parallel(mesh: DeviceMesh, *, buffers: list[Tensor] | None = None,
                     buffer_seq_dims: list[int] | None = None,
                     no_restore_buffers: set[Tensor] | None = None) -> Iterator[None]:
    """Shard `buffers` in place along `buffer_seq_dims` over the 1-D `mesh` (this rank keeps its slice) and make
    `scaled_dot_product_attention` attend over the whole sequence; on exit the buffers get their full contents
    back (those in `no_restore_buffers` keep the slice). Buffers are the inputs, labels and position tables."""
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if buffer_seq_dims is None else list(buffer_seq_dims)
    keep_sliced = [] if no_restore_buffers is None else list(no_restore_buffers)
    if mesh.ndim != 1:
        raise ValueError(f"spmd: context_parallel takes a 1-D mesh (the context-parallel dimension, e.g. "
                         f"mesh['cp']); got {mesh.ndim}-D {mesh.shape}")
    seq = _check_buffers(buffers, seq_dims, "context_parallel")
    if any(not any(b is buffer for buffer in buffers) for b in keep_sliced):
        raise ValueError("spmd: context_parallel: no_restore_buffers must be a subset of buffers")
    if any(isinstance(b, torch.nn.Parameter) for b in buffers):
        raise ValueError("spmd: context_parallel shards buffers in place; a Parameter cannot be one")
    world_size, rank = mesh.size(), mesh.get_local_rank()
    if seq % world_size:
        raise ValueError(f"spmd: context_parallel: a sequence of {seq} does not divide over {world_size} ranks")
    balancer = _default_load_balancer(seq, world_size, buffers[0].device) if buffers else None
    with torch.no_grad():
        originals = [None if any(b is kept for kept in keep_sliced) else b.clone() for b in buffers]
        for buffer, dim in zip(buffers, seq_dims, strict=True):
            dealt = buffer if balancer is None else buffer.index_select(dim, balancer._generate_indices()[0])
            piece = dealt.chunk(world_size, dim)[rank].clone()
            buffer.resize_(piece.shape)
            buffer.copy_(piece)
    sharding = _Sharding(mesh, head_tail=balancer is not None)
    token = _active.set(sharding)
    _patch.acquire(sharding)
    try:
        yield
    finally:
        _patch.release(sharding)
        _active.reset(token)
        with torch.no_grad():
            for buffer, original in zip(buffers, originals, strict=True):
                if original is not None:
                    buffer.resize_(original.shape)
                    buffer.copy_(original)


@torch.no_grad()
def context_parallel_unshard(mesh: DeviceMesh, buffers: list[Tensor], seq_dims: list[int],
                             load_balancer: _LoadBalancer | None = None) -> list[Tensor]:
    """The whole-sequence tensors whose slices `buffers` are (outputs, losses per token), gathered over `mesh`
    and put back in sequence order; `load_balancer` defaults to the deal `context_parallel` used."""
    local = _check_buffers(buffers, seq_dims, "context_parallel_unshard")
    world_size, group = mesh.size(), mesh.get_group()
    balancer = load_balancer or _default_load_balancer(local * world_size, world_size, buffers[0].device)
    restore = None if balancer is None else balancer._generate_indices(restore=True)
    gathered = [all_gathered(b.contiguous(), dim, group) for b, dim in zip(buffers, seq_dims, strict=True)]
    if restore is None:
        return gathered
    return [rearrange(g, dim, restore) for g, dim in zip(gathered, seq_dims, strict=True)]
