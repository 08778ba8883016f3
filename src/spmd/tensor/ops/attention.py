"""Sharding rules for scaled dot-product attention: the fused kernels F.scaled_dot_product_attention reaches.

Layer: tensor. The rules decide; the local kernel (`kernel=`) guards an empty local shard. On CPU,
F.scaled_dot_product_attention runs `_scaled_dot_product_flash_attention_for_cpu` (and its backward) when
dropout is off; with dropout it runs the math decomposition (bmm, softmax, dropout), which the matmul / norm /
random rules shard. On CUDA it runs the flash, memory-efficient or cuDNN kernels (see Note: attention on
accelerator kernels).

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

Note: context-parallel attention
While `ring_dispatch` is on (torch's `_enable_context_parallel_dispatcher`), q, k and v all sharded on L along
one mesh dim, without a mask or dropout, stay so: the kernel runs ring attention over that mesh dim's group
(tensor.ring_attention; causal or not, head-tail when cp_options.enable_load_balance), its output and
log-sum-exp sharded on L too, and the backward likewise. Other mesh dims may shard B or H as usual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor, ops

from spmd.tensor.ops.custom import LocalKernel, LocalPlan, empty_outputs
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.ring_attention import RingLayout, cp_options, ring_attention_backward, ring_attention_forward
from spmd.tensor.rules import OpSchema, ShardingDecision, ShardingError, Strategy, pick_per_mesh_dim, register_rule
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


@dataclasses.dataclass
class RingDispatch:
    """Whether attention sharded on the sequence runs as ring attention (see Note: context-parallel attention).
    Decisions cached before a change are stale: whoever flips it forgets them (dispatch.forget_decisions)."""

    enabled: bool = False


ring_dispatch = RingDispatch()

_SEQUENCE = Shard(2)


def _ring_dim(schema: OpSchema, specs: tuple[DTensorSpec, ...]) -> int | None:
    """The mesh dim that runs a context-parallel call as ring attention: while the dispatch is on, without mask
    or dropout, the only mesh dim sharding q on L (in `specs`), with k and v sharded on L there too."""
    backward = schema.op is _BACKWARD
    if backward:
        dropout_p = float(schema.args[6])
    else:
        dropout_p = float(schema.args[3]) if len(schema.args) > 3 else float(schema.kwargs.get("dropout_p", 0.0))
    if not ring_dispatch.enabled or isinstance(schema.kwargs.get("attn_mask"), DTensorSpec) or dropout_p:
        return None
    query_position = 1 if backward else 0
    return _sequence_mesh_dim(*specs[query_position:query_position + 3])


def _sequence_mesh_dim(q: DTensorSpec, k: DTensorSpec, v: DTensorSpec) -> int | None:
    """The only mesh dim sharding q on the sequence, if k and v are sharded so there too, else None."""
    dims = [d for d, placement in enumerate(q.placements) if isinstance(placement, Shard) and placement.dim == 2]
    if len(dims) != 1 or k.placements[dims[0]] != _SEQUENCE or v.placements[dims[0]] != _SEQUENCE:
        return None
    return dims[0] if q.placements[dims[0]] == _SEQUENCE else None


def _with_ring(candidates: list[Strategy], ring_dim: int | None, count: int,
               outputs: int) -> Callable[[int], list[Strategy]]:
    """Per mesh dim: the ring's strategy (everything stays sharded on L) on the ring's dim, `candidates` on the
    others."""
    ring = [Strategy((_SEQUENCE,) * count, (_SEQUENCE,) * outputs)]
    return lambda mesh_dim: ring if mesh_dim == ring_dim else candidates


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


def _flash_cpu(schema: OpSchema) -> Callable[[int], list[Strategy]]:
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
    return _with_ring(candidates, _ring_dim(schema, schema.input_specs), len(schema.input_specs), 2)


def _flash_cpu_backward(schema: OpSchema) -> Callable[[int], list[Strategy]]:
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
    return _with_ring(candidates, _ring_dim(schema, schema.input_specs), count, 3)


def _ring_kernel(plan: LocalPlan, mesh_dim: int) -> LocalKernel:
    """Ring attention over the group of `mesh_dim`; the rotate method and load balance are read at each call,
    as torch reads them."""
    group = plan.schema.mesh.get_group(mesh_dim)

    def layout(is_causal: bool, scale: float | None) -> RingLayout:
        head_tail = bool(is_causal) and cp_options.enable_load_balance
        return RingLayout(group, bool(is_causal), head_tail, scale, cp_options.rotate_method)

    def where() -> str:
        return f"spmd DTensor: {plan.op} (context parallel, mesh dim {mesh_dim}) on rank {group.global_rank}"

    if plan.op is _FORWARD:
        def forward(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
                    *, attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
            ring = layout(is_causal, scale)
            ring.check(query, key, value, where())
            return ring_attention_forward(ring, query, key, value)
        return forward

    def backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
                 scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
        return ring_attention_backward(layout(is_causal, scale), grad_out.contiguous(), query, key, value, out,
                                       lse)
    return backward


def _kernel(plan: LocalPlan) -> LocalKernel:
    """The kernel on the local shards: ring attention for a context-parallel call; otherwise the op, except
    that a rank whose query-row shard is empty (5 rows over 4 ranks) returns empty outputs and zero key/value
    gradient contributions itself (the CPU kernel faults on zero rows)."""
    ring_dim = _ring_dim(plan.schema, plan.input_specs)
    if ring_dim is not None:
        return _ring_kernel(plan, ring_dim)
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


# Note: attention on accelerator kernels
# On CUDA, F.scaled_dot_product_attention runs torch's flash, memory-efficient or cuDNN kernels (and their
# backwards), each with its own signature and extra outputs: random-state tensors (philox seed and offset),
# cumulative sequence lengths and maximum lengths (None and ints when the batch is not packed), a debug mask. Their
# rule shards batch or heads (Note: attention sharding), the extra tensors replicated; an attention bias follows
# the scores. Not the query rows: the memory-efficient kernel pads its log-sum-exp to 32 rows, which doesn't shard.
# With dropout the kernels draw in-kernel from the device generator, the same stream on every rank, so a sharded
# call would not draw the one-process numbers: it runs whole (replicated) instead. While the context-parallel
# dispatcher is on, the three ops with q, k, v sharded on the sequence run ring attention (Note: context-parallel
# attention; its blocks on the memory-efficient kernels), returning the op's outputs: the random-state tensors
# zeros, the lengths local. The memory-efficient op rings when the sequence is a multiple of 32 (its log-sum-exp
# pads the rows to one, which then shards as the rows do); otherwise the sequence is resharded (onto the batch).

@dataclasses.dataclass(frozen=True)
class _AcceleratorAttention:
    """Where an accelerator attention op keeps its arguments: `roles` names each positional argument ("q", "k",
    "v" and the like-shaped "out"/"grad", "lse", "bias", "extra" for a random-state or length tensor, None for
    a non-tensor); `outputs` each output ("shard" like q, "lse", "bias", "extra", None for a non-tensor or an
    undefined tensor)."""

    roles: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    dropout: int            # the position of dropout_p
    padded_rows: bool = False   # the memory-efficient kernel's log-sum-exp: rows padded to a multiple of 32


def _argument(schema: OpSchema, position: int, name: str, default: Any) -> Any:
    return schema.args[position] if len(schema.args) > position else schema.kwargs.get(name, default)


def _accelerator_attention(schema: OpSchema) -> list[Strategy] | Callable[[int], list[Strategy]]:
    layout = _ACCELERATOR_OPS[schema.op]
    roles = {role: schema.args[k] for k, role in enumerate(layout.roles)
             if role is not None and k < len(schema.args) and isinstance(schema.args[k], DTensorSpec)}
    query, key, bias = roles["q"], roles["k"], roles.get("bias")
    input_roles = [role for k, role in enumerate(layout.roles)
                   if k < len(schema.args) and isinstance(schema.args[k], DTensorSpec)]
    if len(input_roles) != len(schema.input_specs):
        raise ShardingError(f"{schema.op}: DTensors outside the positions its rule knows")
    replicated = Strategy((Replicate(),) * len(input_roles),
                          tuple(None if kind is None else Replicate() for kind in layout.outputs))
    if float(_argument(schema, layout.dropout, "dropout_p", 0.0)):
        return [replicated]
    candidates = [replicated]
    dims = [0, 1] if query.shape[1] == key.shape[1] else [0]
    for dim in dims:
        bias_placement = _mask_placement(bias, dim, query.shape[dim])
        by_role = {"bias": bias_placement, "extra": Replicate()}
        inputs = tuple(by_role.get(role, Shard(dim)) for role in input_roles)
        outputs = tuple(None if kind is None else
                        (bias_placement if bias is not None else None) if kind == "bias" else
                        Replicate() if kind == "extra" else Shard(dim) for kind in layout.outputs)
        candidates.append(Strategy(inputs, outputs))
    if schema.op in _ACCELERATOR_BACKWARDS:
        grad = schema.input_specs[0]
        for placement in grad.placements:        # linear in the output's gradient
            if isinstance(placement, Partial) and placement.is_linear:
                outputs = tuple(None if kind is None or (kind == "bias" and bias is None) else placement
                                for kind in layout.outputs)
                candidates.append(Strategy((placement,) + (Replicate(),) * (len(input_roles) - 1), outputs))
    ring_dim = _accelerator_ring_dim(schema, schema.input_specs)
    if ring_dim is None:
        return candidates
    ring = [Strategy(tuple(Replicate() if role == "extra" else _SEQUENCE for role in input_roles),
                     tuple(None if kind is None else Replicate() if kind == "extra" else _SEQUENCE
                           for kind in layout.outputs))]
    return lambda mesh_dim: ring if mesh_dim == ring_dim else candidates


def _accelerator_ring_dim(schema: OpSchema, specs: tuple[DTensorSpec, ...]) -> int | None:
    """The mesh dim that runs an accelerator attention call as ring attention (see Note: context-parallel
    attention), or None."""
    layout = _ACCELERATOR_OPS[schema.op]
    if not ring_dispatch.enabled or float(_argument(schema, layout.dropout, "dropout_p", 0.0)):
        return None
    positions = [k for k, role in enumerate(layout.roles)
                 if k < len(schema.args) and isinstance(schema.args[k], DTensorSpec)]
    by_role = {layout.roles[k]: specs[i] for i, k in enumerate(positions)}
    if "bias" in by_role:
        return None
    if layout.padded_rows and by_role["q"].shape[2] % 32:    # its log-sum-exp's rows, padded to 32, would not
        return None                                           # shard as q's
    return _sequence_mesh_dim(by_role["q"], by_role["k"], by_role["v"])


def _accelerator_kernel(plan: LocalPlan) -> LocalKernel:
    """The op on the local shards, or ring attention over the ring's mesh dim, returning what the op returns:
    its output and log-sum-exp, and for the rest what the op's rule computed (random-state tensors, zeros: no
    dropout here; None for the lengths of a packed batch; the local lengths)."""
    ring_dim = _accelerator_ring_dim(plan.schema, plan.input_specs)
    if ring_dim is None:
        return plan.op
    group = plan.schema.mesh.get_group(ring_dim)
    op = plan.op
    cudnn = op in (aten._scaled_dot_product_cudnn_attention.default,
                   aten._scaled_dot_product_cudnn_attention_backward.default)
    efficient = op in (aten._scaled_dot_product_efficient_attention.default,
                       aten._scaled_dot_product_efficient_attention_backward.default)

    def layout(is_causal: bool, scale: float | None) -> RingLayout:
        return RingLayout(group, bool(is_causal), bool(is_causal) and cp_options.enable_load_balance, scale,
                          cp_options.rotate_method)

    def extras(like: Tensor) -> list[Tensor | None]:
        """The random-state (and debug) outputs: the efficient op's last two, the others' from the seventh."""
        return [None if spec is None else like.new_zeros(spec.local_shape(), dtype=spec.dtype)
                for spec in plan.output_specs[2 if efficient else 6:]]

    if efficient and op in _ACCELERATOR_BACKWARDS:
        def efficient_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None,
                               out: Tensor, lse: Tensor, *args: Any, **kwargs: Any) -> tuple:
            is_causal = kwargs.get("is_causal", _positional(args, 4, False))
            grads = ring_attention_backward(layout(is_causal, kwargs.get("scale")), grad_out.contiguous(), query,
                                            key, value, out, lse)
            return (*grads, None)
        return efficient_backward

    if op in _ACCELERATOR_BACKWARDS:
        def backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                     *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
            is_causal = kwargs.get("is_causal", args[8] if cudnn else args[5])
            return ring_attention_backward(layout(is_causal, kwargs.get("scale")), grad_out.contiguous(), query,
                                           key, value, out, lse.squeeze(-1) if cudnn else lse)
        return backward

    def forward(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> tuple:
        is_causal = kwargs.get("is_causal", _positional(args, 3 if cudnn or efficient else 1, False))
        ring = layout(is_causal, kwargs.get("scale"))
        ring.check(query, key, value, f"spmd DTensor: {op} (context parallel, mesh dim {ring_dim}) on rank "
                                      f"{group.global_rank}")
        out, lse = ring_attention_forward(ring, query, key, value)
        if efficient:
            return (out, lse, *extras(query))
        return (out, lse.unsqueeze(-1) if cudnn else lse, None, None, query.shape[-2], key.shape[-2],
                *extras(query))
    return forward


def _positional(args: tuple, index: int, default: Any) -> Any:
    return args[index] if len(args) > index else default


_ACCELERATOR_OPS = {
    aten._scaled_dot_product_flash_attention.default: _AcceleratorAttention(
        ("q", "k", "v", None, None, None), ("shard", "lse", None, None, None, None, "extra", "extra", "extra"),
        dropout=3),
    aten._scaled_dot_product_flash_attention_backward.default: _AcceleratorAttention(
        ("grad", "q", "k", "v", "out", "lse", "extra", "extra", None, None, None, None, "extra", "extra"),
        ("shard", "shard", "shard"), dropout=10),
    aten._scaled_dot_product_efficient_attention.default: _AcceleratorAttention(
        ("q", "k", "v", "bias", None, None, None), ("shard", "lse", "extra", "extra"), dropout=5,
        padded_rows=True),
    aten._scaled_dot_product_efficient_attention_backward.default: _AcceleratorAttention(
        ("grad", "q", "k", "v", "bias", "out", "lse", "extra", "extra", None, None, None),
        ("shard", "shard", "shard", "bias"), dropout=9, padded_rows=True),
    aten._scaled_dot_product_cudnn_attention.default: _AcceleratorAttention(
        ("q", "k", "v", "bias", None, None, None, None),
        ("shard", "lse", None, None, None, None, "extra", "extra", None), dropout=5),
    aten._scaled_dot_product_cudnn_attention_backward.default: _AcceleratorAttention(
        ("grad", "q", "k", "v", "out", "lse", "extra", "extra", "bias", "extra", "extra", None, None, None, None),
        ("shard", "shard", "shard"), dropout=13),
}
_ACCELERATOR_BACKWARDS = {aten._scaled_dot_product_flash_attention_backward.default,
                          aten._scaled_dot_product_efficient_attention_backward.default,
                          aten._scaled_dot_product_cudnn_attention_backward.default}


@register_rule(*_ACCELERATOR_OPS, kernel=_accelerator_kernel)
def _accelerator_rule(schema: OpSchema) -> ShardingDecision:
    return pick_per_mesh_dim(schema, _accelerator_attention(schema))
