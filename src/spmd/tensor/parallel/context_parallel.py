"""Context parallelism by module (torch's newer API, the one TorchTitan uses): `_context_parallel_shard` deals
the batch's sequence buffers out, `_ContextParallel` applied to each attention module (by `parallelize_module`)
makes its query, key and value DTensors sharded on the sequence, and `_enable_context_parallel_dispatcher` makes
DTensor run attention on such tensors as ring attention (ops.attention's Note: context-parallel attention).
With `AttentionType.FLEX` the module's keys and values are gathered instead and flex_attention runs on plain
tensors with the BlockMask `_context_parallel_shard` made for this rank (tensor.parallel.flex_attention).

Layer: tensor.parallel (torch serves it at `tensor.experimental._attention`, an alias here). Unlike
`context_parallel` (the context manager), nothing is patched and no buffer is changed in
place: the model's other modules see this rank's slice as plain tensors, and only the attention modules
communicate.

Note (the protocol): every rank of the context-parallel mesh shards the same buffers the same way and runs the
same attention modules in the same order; each attention call is one ring pass (or one all-gather) forward and
one backward over the mesh (tensor.ring_attention's Note; for FLEX, tensor.parallel.flex_attention's).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._pytree import tree_flatten, tree_unflatten

from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import forget_decisions
from spmd.tensor.experimental.load_balancer import _LoadBalancer, rearrange
from spmd.tensor.ops.attention import ring_dispatch
from spmd.tensor.parallel.flex_attention import gather_flex_inputs, shard_block_mask
from spmd.tensor.parallel.style import ParallelStyle, check_one_d
from spmd.tensor.placement import Shard
from spmd.tensor.ring_attention import Visibility, cp_options, visibility

CPBuffer = Tensor | BlockMask

__all__ = ["_CausalBehavior", "_ContextParallel", "_context_parallel_shard", "_disable_context_parallel_dispatcher",
           "_enable_context_parallel_dispatcher", "_is_causal_behavior"]


class _CausalBehavior(enum.Enum):
    """torch's name for what one ring step computes: nothing, the whole block, or the block under a causal mask
    (the values are the `is_causal` argument each case passes to the attention kernel)."""

    SKIP = None
    NOT_IS_CAUSAL = False
    IS_CAUSAL = True


def _is_causal_behavior(rank: int, world_size: int, i: int, is_causal: bool) -> _CausalBehavior:
    """What rank `rank` computes at ring step `i` (the block of rank (rank - i) mod world_size), with the
    head-tail layout when load balancing is on."""
    part = visibility(rank, (rank - i) % world_size, is_causal, cp_options.enable_load_balance)
    if part is Visibility.NONE:
        return _CausalBehavior.SKIP
    return _CausalBehavior.IS_CAUSAL if part is Visibility.CAUSAL else _CausalBehavior.NOT_IS_CAUSAL


def _enable_context_parallel_dispatcher() -> None:
    """Make DTensor attention whose query, key and value are sharded on the sequence run as ring attention."""
    ring_dispatch.enabled = True
    forget_decisions()


def _disable_context_parallel_dispatcher() -> None:
    """Undo `_enable_context_parallel_dispatcher`: such attention gathers the sequence again, as any DTensor op."""
    ring_dispatch.enabled = False
    forget_decisions()


class _ContextParallel(ParallelStyle):
    """The style of an attention module under context parallelism: its tensor arguments become DTensors sharded
    on `seq_dim` of the 1-D mesh (this rank's slice), its DTensor outputs this rank's slice again."""

    class AttentionType(enum.Enum):
        FLEX = "flex_attention"
        SDPA = "scaled_dot_product_attention"

    def __init__(self, seq_dim: int, attention_type: AttentionType) -> None:
        super().__init__()
        if attention_type is self.AttentionType.SDPA and seq_dim != 2:
            raise ValueError(f"spmd: _ContextParallel: scaled_dot_product_attention's sequence is dim 2 of "
                             f"(batch, heads, sequence, dim); got seq_dim={seq_dim}")
        self.seq_dim = seq_dim
        self.attention_type = attention_type

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh, fqn: str = "") -> nn.Module:
        check_one_d(device_mesh, self, module, fqn)
        if self.attention_type is self.AttentionType.FLEX:
            module.register_forward_pre_hook(functools.partial(self.flex_input_fn, mesh=device_mesh),
                                              with_kwargs=True)
            return module
        module.register_forward_pre_hook(functools.partial(self.sdpa_input_fn, mesh=device_mesh),
                                          with_kwargs=True)
        module.register_forward_hook(functools.partial(self.sdpa_output_fn, mesh=device_mesh))
        return module

    def flex_input_fn(self, module: nn.Module | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                      mesh: DeviceMesh) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The module's key and value (this rank's slices) replaced by the whole sequence's, gathered over the
        mesh; the query stays this rank's slice, to attend with the block mask `_context_parallel_shard` made."""
        return gather_flex_inputs(args, kwargs, self.seq_dim, mesh)

    def sdpa_input_fn(self, module: nn.Module | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                      mesh: DeviceMesh) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Every tensor argument as a DTensor sharded on the sequence (a DTensor must already be so)."""
        if not ring_dispatch.enabled:
            raise RuntimeError("spmd: a _ContextParallel attention module ran before "
                               "_enable_context_parallel_dispatcher(); call it once before the forward")
        placements = (Shard(self.seq_dim),)

        def shard(value: Any) -> Any:
            if isinstance(value, DTensor):
                if value.placements != placements:
                    raise ValueError(f"spmd: _ContextParallel on mesh rank {mesh.get_local_rank()}: a DTensor "
                                     f"argument placed {list(value.placements)}; expected {list(placements)}")
                return value
            if isinstance(value, Tensor):
                return DTensor.from_local(value, mesh, placements, run_check=False)
            return value
        return tuple(shard(a) for a in args), {name: shard(v) for name, v in kwargs.items()}

    def sdpa_output_fn(self, module: nn.Module | None, inputs: Any, outputs: Any, mesh: DeviceMesh) -> Any:
        """The module's DTensor outputs as this rank's slices."""
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs


def _context_parallel_shard(mesh: DeviceMesh, buffers: Sequence[CPBuffer] | Mapping[str, CPBuffer],
                            seq_dims: Sequence[int] | Mapping[str, int],
                            load_balancer: _LoadBalancer | None = None) -> Any:
    """This rank's slices of `buffers` (the inputs, labels, positions: a list, tuple or dict, returned in the
    same form) along their `seq_dims`, dealt by `load_balancer` first; without one, rank r takes the r-th slice.
    As in torch, it also sets whether attention expects the head-tail layout (cp_options.enable_load_balance)."""
    flat, structure = tree_flatten(buffers)
    dims, _ = tree_flatten(seq_dims)
    if len(flat) != len(dims) or len(buffers) != len(seq_dims):
        raise ValueError(f"spmd: _context_parallel_shard: {len(flat)} buffers but {len(dims)} sequence dims (the "
                         f"same structure is needed)")
    if mesh.ndim != 1:
        raise ValueError(f"spmd: _context_parallel_shard takes the 1-D context-parallel mesh; got {mesh.ndim}-D "
                         f"{mesh.shape}")
    for buffer in flat:
        if not isinstance(buffer, Tensor | BlockMask):
            raise TypeError(f"spmd: _context_parallel_shard shards tensors and flex_attention's BlockMasks; got a "
                            f"{type(buffer).__name__}")
    devices = {b.device if isinstance(b, Tensor) else b.kv_num_blocks.device for b in flat}
    if len(devices) > 1:
        raise ValueError(f"spmd: _context_parallel_shard: the buffers are on several devices "
                         f"({sorted(str(d) for d in devices)}); put them on one")
    cp_options.enable_load_balance = load_balancer is not None
    indices = load_balancer._generate_indices() if load_balancer is not None else None
    rank, size = mesh.get_local_rank(), mesh.size()
    shards: list[Tensor | BlockMask] = []
    with torch.no_grad():
        for buffer, dim in zip(flat, dims, strict=True):
            if isinstance(buffer, BlockMask):       # its sequence dims are its own; `dim` is ignored, as in torch
                shards.append(shard_block_mask(buffer, mesh, load_balancer))
                continue
            if buffer.shape[dim] % size:
                raise ValueError(f"spmd: _context_parallel_shard: a sequence of {buffer.shape[dim]} (dim {dim} of "
                                 f"{tuple(buffer.shape)}) does not divide over {size} ranks")
            dealt = buffer if indices is None else rearrange(buffer, dim, indices)
            shards.append(dealt.chunk(size, dim)[rank].clone())
    return tree_unflatten(shards, structure)
