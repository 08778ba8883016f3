"""Sharding rules for scaled dot-product attention: the fused kernels F.scaled_dot_product_attention reaches.

Layer: tensor. The rules decide; the local kernel (`kernel=`) guards an empty local shard. On CPU,
F.scaled_dot_product_attention runs `_scaled_dot_product_flash_attention_for_cpu` (and its backward) when
dropout is off; with dropout it runs the math decomposition (bmm, softmax, dropout), which the matmul / norm /
random rules shard.

Note: attention sharding
Attention is independent per (batch, head): q, k, v of shape (B, H, L, E) / (B, H, S, E), the output
(B, H, L, Ev) and the log-sum-exp (B, H, L) all shard the same way along B or H, with no communication (the
usual tensor-parallel layout shards heads). The mask (broadcastable to (B, H, L, S)) follows where it has that
dim at full size, else stays Replicate. Sharding H needs as many key/value heads as query heads (with grouped
heads a chunk of query heads would not line up with its chunk of kv heads). Without a causal mask the query
length L can be sharded too, with k and v Replicate: each rank attends its query rows to every key; the
gradients of k and v, sums over all query rows, come out Partial(sum). (A causal mask is aligned to local
positions inside the kernel, so L is not sharded then.) The backward is linear in the output gradient, so a
Partial gradient passes through as Partial.
"""

from __future__ import annotations

from typing import Any

from torch import ops

from spmd.tensor.ops.custom import LocalKernel, LocalPlan, empty_outputs
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import OpSchema, ShardingDecision, Strategy, pick_per_mesh_dim, register_rule
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


def _mask_placement(mask: DTensorSpec | None, dim: int, full: int) -> Placement:
    """The mask's placement when the (4-d, broadcast) attention scores are sharded on `dim` of size `full`."""
    if mask is None:
        return Replicate()
    mask_dim = dim - (4 - mask.ndim)
    if mask_dim >= 0 and mask.shape[mask_dim] == full:
        return Shard(mask_dim)
    return Replicate()


def _shardable_dims(query: DTensorSpec, key: DTensorSpec, is_causal: bool) -> list[int]:
    dims = [0]
    if query.shape[1] == key.shape[1]:
        dims.append(1)
    if not is_causal:
        dims.append(2)
    return dims


def _flash_cpu(schema: OpSchema) -> list[Strategy]:
    # args: query, key, value, dropout_p, is_causal; kwargs: attn_mask, scale -> (output, logsumexp)
    query, key = schema.input_specs[0], schema.input_specs[1]
    is_causal = bool(schema.args[4]) if len(schema.args) > 4 else bool(schema.kwargs.get("is_causal", False))
    mask = schema.kwargs.get("attn_mask")
    mask = mask if isinstance(mask, DTensorSpec) else None
    has_mask = (mask,) if mask is not None else ()
    candidates = [Strategy((Replicate(),) * len(schema.input_specs), (Replicate(), Replicate()))]
    for dim in _shardable_dims(query, key, is_causal):
        kv = Shard(dim) if dim < 2 else Replicate()
        masks = tuple(_mask_placement(m, dim, query.shape[dim]) for m in has_mask)
        candidates.append(Strategy((Shard(dim), kv, kv, *masks), (Shard(dim), Shard(dim))))
    return candidates


def _flash_cpu_backward(schema: OpSchema) -> list[Strategy]:
    # args: grad_out, query, key, value, out, logsumexp, dropout_p, is_causal; kwargs: attn_mask, scale
    grad, query, key = schema.input_specs[0], schema.input_specs[1], schema.input_specs[2]
    is_causal = bool(schema.args[7])
    mask = schema.kwargs.get("attn_mask")
    mask = mask if isinstance(mask, DTensorSpec) else None
    has_mask = (mask,) if mask is not None else ()
    count = len(schema.input_specs)
    candidates = [Strategy((Replicate(),) * count, (Replicate(),) * 3)]
    for dim in _shardable_dims(query, key, is_causal):
        masks = tuple(_mask_placement(m, dim, query.shape[dim]) for m in has_mask)
        if dim < 2:
            candidates.append(Strategy((Shard(dim),) * 6 + masks, (Shard(dim),) * 3))
        else:          # query rows sharded: dk and dv sum over every query row
            inputs = (Shard(2), Shard(2), Replicate(), Replicate(), Shard(2), Shard(2), *masks)
            candidates.append(Strategy(inputs, (Shard(2), Partial(), Partial())))
    for placement in grad.placements:
        if isinstance(placement, Partial) and placement.is_linear:
            candidates.append(Strategy((placement,) + (Replicate(),) * (count - 1), (placement,) * 3))
    return candidates


def _kernel(plan: LocalPlan) -> LocalKernel:
    """The kernel on the local shards. A rank whose query-row shard is empty (5 rows over 4 ranks) returns
    empty outputs and zero key/value gradient contributions itself: the CPU kernel faults on zero rows."""
    op, query_position = plan.op, 1 if plan.op is _BACKWARD else 0

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if args[query_position].shape[2] != 0:
            return op(*args, **kwargs)
        return empty_outputs(plan, args[query_position], zeros=True)
    return kernel


_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_STRATEGIES = {_FORWARD: _flash_cpu, _BACKWARD: _flash_cpu_backward}


def _rule(schema: OpSchema) -> ShardingDecision:
    return pick_per_mesh_dim(schema, _STRATEGIES[schema.op](schema))


register_rule(_FORWARD, _BACKWARD, kernel=_kernel)(_rule)
