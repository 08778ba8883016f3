"""Sharding rules for embedding lookups, including a vocab-sharded table, and their backward.

Layer: tensor. `embedding` runs a local kernel (`kernel=`, see rules.py) for the vocab-sharded case;
`embedding_dense_backward` is a plain rule.

Note: embedding sharding
out[..., :] = weight[ids[...], :]. On one mesh dim:
  - ids sharded along any of their dims, weight Replicate -> the output is sharded the same way;
  - weight Shard(1) (embedding dim), ids Replicate -> output Shard(last);
  - weight Shard(0) (vocab rows), ids Replicate -> each rank looks up only the ids inside its row range
    [offset, offset + rows), writes zeros for the others, and the output is Partial(sum): exactly one rank
    holds each id's row. No communication in the lookup; the all-reduce (or a reduce-scatter, for sequence
    parallel) is deferred to the consumer, as in Megatron's vocab-parallel embedding.
  - weight Partial, ids Replicate -> Partial (a lookup is linear in the table).
Backward (`embedding_dense_backward(grad, ids, num_weights, ...)`): the weight gradient scatters-adds grad
rows into the table. grad Shard(last) -> Shard(1); grad and ids sharded along the same row dim -> Partial(sum)
(each rank adds its rows; not with scale_grad_by_freq, which needs global id counts); grad Partial -> Partial;
otherwise Replicate. The backward op does not know the weight's placement, so a vocab-sharded table's gradient
comes out Replicate (as torch's DTensor does); the optimizer's in-place update takes its rows locally, without
communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, ops

from spmd.tensor.ops.custom import LocalKernel, LocalPlan
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import (
    OpSchema,
    ShardingDecision,
    Strategy,
    pick_per_mesh_dim,
    register_rule,
    register_strategy,
    replicated,
)
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


def _lookup_strategies(schema: OpSchema) -> list[Strategy]:
    """Candidates for embedding(weight, ids) with both DTensors (see Note: embedding sharding)."""
    weight, ids = schema.input_specs
    candidates = [Strategy((Replicate(), Replicate()), Replicate()),
                  *(Strategy((Replicate(), Shard(d)), Shard(d)) for d in range(ids.ndim)),
                  Strategy((Shard(1), Replicate()), Shard(ids.ndim)),
                  Strategy((Shard(0), Replicate()), Partial())]
    for placement in weight.placements:
        if isinstance(placement, Partial) and placement.is_linear:
            candidates.append(Strategy((placement, Replicate()), placement))
    return candidates


def _lookup_rule(schema: OpSchema) -> ShardingDecision:
    if not isinstance(schema.args[1], DTensorSpec):      # a one-element plain id tensor: use the whole table
        return ShardingDecision(replicated(schema.mesh), [replicated(schema.mesh)])
    return pick_per_mesh_dim(schema, _lookup_strategies(schema))


def _lookup_kernel(plan: LocalPlan) -> LocalKernel:
    weight_spec = plan.input_specs[0]
    if not weight_spec.shard_mesh_dims(0):
        return plan.op
    # vocab-sharded: look up the ids this rank's rows hold, zeros for the rest (see Note: embedding sharding)
    local_shape, offset = weight_spec.local_shape_and_offset(weight_spec.mesh.get_coordinate())
    first, rows = offset[0], local_shape[0]

    def kernel(weight: Tensor, ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if rows == 0:
            return weight.new_zeros((*ids.shape, weight.shape[1]))
        outside = (ids < first) | (ids >= first + rows)
        out = torch.embedding(weight, (ids - first).masked_fill_(outside, 0))
        return out.masked_fill_(outside.unsqueeze(-1), 0)
    return kernel


register_rule(aten.embedding.default, kernel=_lookup_kernel)(_lookup_rule)


@register_strategy(aten.embedding_dense_backward.default)
def _embedding_backward(schema: OpSchema) -> list[Strategy]:
    # args: grad_output, indices, num_weights, padding_idx, scale_grad_by_freq; the indices are a DTensor, or a
    # plain one-element tensor (one id, the same on every rank)
    grad, *ids = schema.input_specs
    scale_by_freq = bool(schema.args[4])
    with_ids = (Replicate(),) if ids else ()
    candidates = [Strategy((Replicate(), *with_ids), Replicate()),
                  Strategy((Shard(grad.ndim - 1), *with_ids), Shard(1))]
    if ids and not scale_by_freq:
        candidates += [Strategy((Shard(d), Shard(d)), Partial()) for d in range(ids[0].ndim)]
    partials: list[Placement] = [p for p in grad.placements if isinstance(p, Partial) and p.is_linear]
    candidates += [Strategy((p, *with_ids), p) for p in dict.fromkeys(partials)]
    return candidates
