"""Sharding rules for losses: nll_loss (and so cross_entropy = log_softmax + nll_loss) and mse_loss.

Layer: tensor. `nll_loss_forward` and `mse_loss` (+ backward) run local kernels (`kernel=`, see rules.py)
so that a mean over sharded rows is exact; `nll_loss_backward` is a plain rule.

Note: nll_loss sharding
loss_i = -w[t_i] * x[i, t_i], reduced by none / sum / mean, where mean divides the sum by the total weight
W = sum_i w[t_i] over rows whose target isn't ignore_index. The class dim (dim 1, or 0 for a single sample)
is read at one position per row, so it is kept whole; the row dims (batch, and the spatial dims of
nll_loss2d) are independent:
  - rows sharded, `none`: the losses stay sharded like the target;
  - rows sharded, `sum`: each rank's sum is a Partial(sum) of the loss, and its W a Partial(sum) of W;
  - rows sharded, `mean`: each rank computes its (sum, W) pair, ONE all-reduce of the pair gives the global
    pair, and sum / W is the exact mean on every rank (Replicate). Averaging per-rank means instead would be
    wrong with uneven shards, class weights, or ignored targets.
  - the loss is linear in x: a Partial x (target Replicate) gives a Partial loss with no communication.
The backward is d loss / d x[i, t_i] = -w[t_i] * grad (/ W for mean): rows stay sharded, the W it divides
by must be the global one (Replicate), and it is linear in the incoming gradient (Partial passes through).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, ops

from spmd.comm.reduce_op import ReduceOp
from spmd.tensor.ops.custom import LocalKernel, LocalPlan
from spmd.tensor.ops.reduction import all_reduce_mesh_dims
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import OpSchema, ShardingDecision, Strategy, pick_per_mesh_dim, register_rule
from spmd.tensor.spec import DTensorSpec

aten = ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _row_dims(input_ndim: int) -> list[tuple[int, int]]:
    """(input dim, target dim) pairs of the row dims: every input dim but the class dim."""
    if input_ndim < 2:
        return []
    return [(0, 0)] + [(d, d - 1) for d in range(2, input_ndim)]


def _per_input(schema: OpSchema, placements: dict[int, Placement], default: Placement) -> tuple[Placement, ...]:
    """One placement per DTensor input: `placements[i]` for positional argument i, else `default`."""
    return tuple(placements.get(index, default) for index, arg in enumerate(schema.args)
                 if isinstance(arg, DTensorSpec))


def _forward_strategies(schema: OpSchema) -> Callable[[int], list[Strategy]]:
    # args: input, target, weight, reduction, ignore_index -> (output, total_weight)
    spec = schema.input_specs[0]
    reduction = schema.args[3]

    def candidates(mesh_dim: int) -> list[Strategy]:
        found = [Strategy(_per_input(schema, {}, Replicate()), (Replicate(), Replicate()))]
        for dim, target_dim in _row_dims(spec.ndim):
            inputs = _per_input(schema, {0: Shard(dim), 1: Shard(target_dim)}, Replicate())
            if reduction == _NONE:
                found.append(Strategy(inputs, (Shard(target_dim), Replicate())))
            else:         # mean: the kernel all-reduces (sum, W) and returns Replicate (see Note: nll_loss sharding)
                found.append(Strategy(inputs, (Partial(), Partial())))
        own = spec.placements[mesh_dim]
        if isinstance(own, Partial) and own.is_linear:
            found.append(Strategy(_per_input(schema, {0: own}, Replicate()), (own, Replicate())))
        return found

    return candidates


def _row_sharding_mesh_dims(call_or_schema_specs: tuple[DTensorSpec, ...]) -> list[int]:
    spec = call_or_schema_specs[0]
    rows = {dim for dim, _ in _row_dims(spec.ndim)}
    return [i for i, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in rows]


def _forward_rule(schema: OpSchema) -> ShardingDecision:
    decision = pick_per_mesh_dim(schema, _forward_strategies(schema))
    if schema.args[3] != _MEAN:
        return decision
    targets = decision.input_placements[0] or schema.input_specs[0].placements
    out, _ = decision.output_placements
    sharded = _row_sharding_mesh_dims((schema.input_specs[0].with_placements(tuple(targets)),))
    loss = tuple(Replicate() if i in sharded else p for i, p in enumerate(out))
    weight = tuple(Replicate() for _ in out)
    return ShardingDecision((loss, weight), decision.input_placements)


def _forward_kernel(plan: LocalPlan) -> LocalKernel:
    spec = plan.input_specs[0]
    sharded = _row_sharding_mesh_dims(plan.input_specs)
    op = plan.op
    if plan.schema.args[3] != _MEAN or not sharded:
        return op

    def kernel(x: Tensor, target: Tensor, weight: Tensor | None, reduction: int, ignore_index: int) -> Any:
        total, total_weight = op(x, target, weight, _SUM, ignore_index)
        pair = torch.stack([total, total_weight.to(total.dtype)])       # one all-reduce for both
        pair = all_reduce_mesh_dims(pair, spec, sharded, ReduceOp.SUM)
        return pair[0] / pair[1], pair[1].to(total_weight.dtype)
    return kernel


register_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, kernel=_forward_kernel)(_forward_rule)


@register_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def _nll_loss_backward(schema: OpSchema) -> ShardingDecision:
    # args: grad_output, input, target, weight, reduction, ignore_index, total_weight -> grad_input
    grad, spec = schema.input_specs[0], schema.input_specs[1]
    reduction = schema.args[4]
    total_weight_index = 6

    def candidates(mesh_dim: int) -> list[Strategy]:
        own = spec.placements[mesh_dim]
        # grad_input's value doesn't depend on the input's values, only its shape: a Partial input needn't be
        # reduced, it is read as the full-shaped local tensor it already is.
        input_placement: Placement = own if isinstance(own, Partial) else Replicate()
        weight_placement = schema.input_specs[-1].placements[mesh_dim] if reduction != _MEAN else Replicate()
        fixed = {1: input_placement, total_weight_index: weight_placement}
        found = [Strategy(_per_input(schema, fixed, Replicate()), Replicate())]
        for dim, target_dim in _row_dims(spec.ndim):
            rows = {1: Shard(dim), 2: Shard(target_dim), total_weight_index: weight_placement}
            if reduction == _NONE:
                rows[0] = Shard(target_dim)
            found.append(Strategy(_per_input(schema, rows, Replicate()), Shard(dim)))
        incoming = grad.placements[mesh_dim]
        if isinstance(incoming, Partial) and incoming.is_linear:
            found.append(Strategy(_per_input(schema, {**fixed, 0: incoming}, Replicate()), incoming))
        return found

    return pick_per_mesh_dim(schema, candidates)



# -- mse_loss -------------------------------------------------------------------------------------------------
# Note: mse_loss sharding
# (x - t)^2 elementwise, then none / sum / mean over every element: x and t share one layout (Partial inputs
# are reduced: the square isn't linear); 'none' keeps it; 'sum' of a sharded layout is Partial(sum) of the
# local sums; 'mean' is Partial(sum) of (local sum / GLOBAL count), exact with uneven shards. The backward,
# 2 (x - t) grad (/ N for mean), follows x, with the same global N.

def _mse_args(schema: OpSchema) -> tuple[bool, int, DTensorSpec]:
    """(is the backward, reduction, the spec giving the elementwise shape: x's, or t's if x is a plain scalar)."""
    backward = schema.op is aten.mse_loss_backward.default
    first = 1 if backward else 0          # forward (x, t, reduction); backward (grad, x, t, reduction)
    reduction = schema.args[first + 2] if len(schema.args) > first + 2 else _MEAN
    x, t = schema.args[first], schema.args[first + 1]
    return backward, reduction, x if isinstance(x, DTensorSpec) and x.ndim >= t.ndim else t


def _mse_rule(schema: OpSchema) -> ShardingDecision:
    backward, reduction, x = _mse_args(schema)
    first = 1 if backward else 0

    def candidates(mesh_dim: int) -> list[Strategy]:
        found = [Strategy(_per_input(schema, {}, Replicate()), Replicate())]
        for dim in range(x.ndim):
            shard = Shard(dim)
            layout = {first: shard, first + 1: shard}
            if backward:        # grad_output: a scalar for sum / mean, laid out like x for none
                found.append(Strategy(_per_input(schema, {**layout, 0: shard if reduction == _NONE else
                                                          Replicate()}, Replicate()), shard))
            else:
                found.append(Strategy(_per_input(schema, layout, Replicate()),
                                      shard if reduction == _NONE else Partial()))
        return found

    return pick_per_mesh_dim(schema, candidates)


def _mse_kernel(plan: LocalPlan) -> LocalKernel:
    backward, reduction, _ = _mse_args(plan.schema)
    sharded = any(isinstance(p, Shard) for spec in plan.input_specs for p in spec.placements)
    if reduction != _MEAN or not sharded:
        return plan.op
    op = plan.op
    count = max(math.prod(plan.output_specs[0].shape) if backward else 0,
                *(math.prod(spec.shape) for spec in plan.input_specs))

    def kernel(*args: Any) -> Tensor:
        return op(*args[: 3 if backward else 2], _SUM) / count
    return kernel


register_rule(aten.mse_loss.default, aten.mse_loss_backward.default, kernel=_mse_kernel)(_mse_rule)
