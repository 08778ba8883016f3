"""Sharding rules for reductions: sum, prod, mean, amax/amin, max/min, any/all, argmax/argmin, logsumexp, var/std,
vector norms.

Layer: tensor. The rules decide; `mean`, `var`/`std` and the norms use local kernels (`kernel=`, see rules.py)
because their local computation over a shard is not the op itself.

Note: reducing over a sharded dim
Reducing a dim that a mesh dim shards leaves each rank with the reduction of its own piece. For a reduction
that composes (sum of sums, max of maxes) that is a Partial of the same op: no communication now, one
all-reduce later if anyone needs the value (and often nobody does before another linear op).
  - sum -> Partial(sum); prod -> Partial(product); amax / max() -> Partial(max); amin / min() -> Partial(min).
  - mean -> Partial(sum) of (local sum / GLOBAL count): exact with uneven shards, where averaging local means
    would weigh a short shard like a long one.
  - var / std -> two passes: the local sums are all-reduced to the global mean (a small tensor, the size of
    the output), then each rank sums its squared deviations: var is Partial(sum) of those / (N - correction);
    std needs the square root of the reduced value, so it is all-reduced and Replicate.
  - vector norm of order p -> Partial(sum) of sum |x|^p, all-reduced, then ^(1/p) (Replicate); p = 1 stays
    Partial(sum), p = inf is Partial(max) of the local max |x|, p = -inf Partial(min), p = 0 Partial(sum).
  - max/min with a dim, argmax/argmin: their indices are positions in the whole dim, so the reduced dim is
    gathered first (kept dims stay sharded); so is logsumexp's (a log of a sum is no Partial).
A dim not reduced stays sharded, renumbered when keepdim is False. Partial inputs stay Partial through the
linear reductions (sum, mean: a sum of partial sums is a partial sum) and through amax of a Partial(max);
everything else reduces a Partial input first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, ops

from spmd.comm.functional import all_reduced
from spmd.comm.reduce_op import ReduceOp
from spmd.tensor.ops.custom import LocalKernel, LocalPlan, empty_outputs
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import (
    OpSchema,
    ShardingDecision,
    Strategy,
    pick_per_mesh_dim,
    register_rule,
    register_strategy,
)
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


def reduction_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    """Normalized, sorted reduced dims; None or an empty list means every dim (as aten's sum/amax/var do)."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(ndim))
    rank = max(ndim, 1)
    return tuple(sorted({d % rank for d in dims}))


def kept_dim(dim: int, reduced: Sequence[int], keepdim: bool) -> int:
    """Where tensor dim `dim` (not reduced) lands in the output."""
    return dim if keepdim else dim - sum(1 for r in reduced if r < dim)


def reduction_strategies(spec: DTensorSpec, reduced: Sequence[int], keepdim: bool, partial_op: str | None,
                         keeps_partial: Sequence[str] = ()) -> list[Strategy]:
    """Candidates for a one-input reduction over `reduced` (see Note: reducing over a sharded dim).

    `partial_op`: the Partial a sharded reduced dim becomes (None: such a dim must be gathered first).
    `keeps_partial`: Partial input ops that pass through as the same Partial.
    """
    other_partials = {p.reduce_op for p in spec.placements if isinstance(p, Partial)} - {partial_op}
    candidates = [Strategy((Replicate(),), Replicate())]
    for dim in range(spec.ndim):
        if dim not in reduced:
            out_dim = kept_dim(dim, reduced, keepdim)
            candidates.append(Strategy((Shard(dim),), Shard(out_dim)))
        elif partial_op is not None and not other_partials:      # one spec can't mix Partial ops
            candidates.append(Strategy((Shard(dim),), Partial(partial_op)))
    for reduce_op in keeps_partial:
        candidates.append(Strategy((Partial(reduce_op),), Partial(reduce_op)))
    return candidates


def _keepdim(schema: OpSchema, position: int) -> bool:
    args = schema.args
    return bool(args[position]) if len(args) > position else bool(schema.kwargs.get("keepdim", False))


# -- sum ------------------------------------------------------------------------------------------------

@register_strategy(aten.sum.default, aten.sum.dim_IntList)
def _sum(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]
    if schema.op is aten.sum.default:
        return reduction_strategies(spec, tuple(range(spec.ndim)), False, "sum", ("sum", "avg"))
    dims = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim")
    return reduction_strategies(spec, reduction_dims(dims, spec.ndim), _keepdim(schema, 2), "sum", ("sum", "avg"))


@register_strategy(aten.prod.default, aten.prod.dim_int)
def _prod(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]
    if schema.op is aten.prod.default:
        reduced, keepdim = tuple(range(spec.ndim)), False
    else:
        reduced, keepdim = reduction_dims(schema.args[1], spec.ndim), _keepdim(schema, 2)
    return reduction_strategies(spec, reduced, keepdim, "product", ("product",))   # an empty shard's prod is 1


@register_strategy(aten.logsumexp.default)
def _logsumexp(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]       # log of a sum of exps: not a Partial of anything, so reduced dims gathered
    return reduction_strategies(spec, reduction_dims(schema.args[1], spec.ndim), _keepdim(schema, 2), None)


# -- any, all ----------------------------------------------------------------------------------------------

_LOGICAL_OPS = {aten.any.default: "max", aten.any.dim: "max", aten.any.dims: "max",
                aten.all.default: "min", aten.all.dim: "min", aten.all.dims: "min"}


@register_strategy(*_LOGICAL_OPS)
def _any_all(schema: OpSchema) -> list[Strategy]:
    """any is a max over bools and all a min; an empty shard's any/all (False/True) is that op's identity."""
    spec = schema.input_specs[0]
    reduce_op = _LOGICAL_OPS[schema.op]
    if schema.op in (aten.any.default, aten.all.default):
        return reduction_strategies(spec, tuple(range(spec.ndim)), False, reduce_op)
    dims = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim")
    return reduction_strategies(spec, reduction_dims(dims, spec.ndim), _keepdim(schema, 2), reduce_op)


# -- amax, amin, max(), min() ------------------------------------------------------------------------------

_EXTREMUM_OPS = {aten.amax.default: "max", aten.amin.default: "min", aten.max.default: "max",
                 aten.min.default: "min"}


def _extremum_dims(schema: OpSchema, ndim: int) -> tuple[tuple[int, ...], bool]:
    if schema.op in (aten.max.default, aten.min.default):
        return tuple(range(ndim)), False
    dims = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", [])
    return reduction_dims(dims, ndim), _keepdim(schema, 2)


def _extremum_rule(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    reduced, keepdim = _extremum_dims(schema, spec.ndim)
    reduce_op = _EXTREMUM_OPS[schema.op]
    return pick_per_mesh_dim(schema, reduction_strategies(spec, reduced, keepdim, reduce_op, (reduce_op,)))


def _identity(dtype: torch.dtype, reduce_op: str) -> float | int | bool:
    """The value a rank with an empty shard contributes to a Partial(max/min): the op's identity."""
    if dtype == torch.bool:
        return reduce_op == "min"
    if dtype.is_floating_point:
        return -math.inf if reduce_op == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if reduce_op == "max" else info.max


def _extremum_kernel(plan: LocalPlan) -> LocalKernel:
    op, out_spec = plan.op, plan.output_specs[0]
    fill = _identity(plan.input_specs[0].dtype, _EXTREMUM_OPS[op])

    def kernel(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if x.numel() == 0:                 # an empty trailing shard (torch.chunk) contributes the identity
            return x.new_full(out_spec.local_shape(), fill)
        return op(x, *args, **kwargs)
    return kernel


register_rule(*_EXTREMUM_OPS, kernel=_extremum_kernel)(_extremum_rule)


# -- reductions that return positions ----------------------------------------------------------------------

@register_strategy(aten.max.dim, aten.min.dim)
def _max_min_dim(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]
    reduced = reduction_dims(schema.args[1], spec.ndim)
    candidates = reduction_strategies(spec, reduced, _keepdim(schema, 2), None)
    return [Strategy(c.inputs, (c.output, c.output)) for c in candidates]      # values and indices


@register_strategy(aten.argmax.default, aten.argmin.default)
def _argmax_argmin(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]
    dim = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim")
    if dim is None:          # position in the flattened tensor: needs every element
        return [Strategy((Replicate(),), Replicate())]
    return reduction_strategies(spec, reduction_dims(dim, spec.ndim), _keepdim(schema, 2), None)


# -- mean ---------------------------------------------------------------------------------------------------

def _sharded_mesh_dims(spec: DTensorSpec, reduced: Sequence[int]) -> list[int]:
    """Mesh dims that shard one of the `reduced` tensor dims."""
    return [i for i, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in reduced]


def _mean_args(schema: OpSchema, ndim: int) -> tuple[tuple[int, ...], bool]:
    if schema.op is aten.mean.default:
        return tuple(range(ndim)), False
    dims = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim")
    return reduction_dims(dims, ndim), _keepdim(schema, 2)


def _mean_rule(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    reduced, keepdim = _mean_args(schema, spec.ndim)
    return pick_per_mesh_dim(schema, reduction_strategies(spec, reduced, keepdim, "sum", ("sum", "avg")))


def _mean_kernel(plan: LocalPlan) -> LocalKernel:
    spec = plan.input_specs[0]
    reduced, keepdim = _mean_args(plan.schema, spec.ndim)
    if not _sharded_mesh_dims(spec, reduced):
        return plan.op
    count = math.prod(spec.shape[d] for d in reduced)
    dims = list(reduced)

    def kernel(x: Tensor, *args: Any, dtype: torch.dtype | None = None) -> Tensor:
        return torch.sum(x, dim=dims, keepdim=keepdim, dtype=dtype) / count
    return kernel


register_rule(aten.mean.default, aten.mean.dim, kernel=_mean_kernel)(_mean_rule)


# -- var / std ----------------------------------------------------------------------------------------------

_STD_OPS = (aten.std.correction, aten.std_mean.correction)
_WITH_MEAN_OPS = (aten.var_mean.correction, aten.std_mean.correction)


def _var_args(schema: OpSchema, ndim: int) -> tuple[tuple[int, ...], float, bool]:
    dims = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim")
    correction = schema.kwargs.get("correction")
    return (reduction_dims(dims, ndim), 1.0 if correction is None else float(correction),
            bool(schema.kwargs.get("keepdim")))


def _without_partial(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _var_rule(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    reduced, _, keepdim = _var_args(schema, spec.ndim)
    # A sharded reduced dim stays sharded: the kernel reduces across ranks itself (see Note: reducing over a
    # sharded dim). var comes out Partial(sum); std and the mean are all-reduced by the kernel: Replicate.
    decision = pick_per_mesh_dim(schema, reduction_strategies(spec, reduced, keepdim, "sum"))
    out = tuple(decision.output_placements)
    value = _without_partial(out) if schema.op in _STD_OPS else out
    if schema.op in _WITH_MEAN_OPS:
        return ShardingDecision([value, _without_partial(out)], decision.input_placements)
    return ShardingDecision(value, decision.input_placements)


def all_reduce_mesh_dims(local: Tensor, spec: DTensorSpec, mesh_dims: Sequence[int], op: ReduceOp) -> Tensor:
    """All-reduce `local` over the groups of `mesh_dims`, one after the other (collective over them)."""
    for mesh_dim in mesh_dims:
        if spec.mesh.size(mesh_dim) > 1:
            local = all_reduced(local, op, spec.mesh.get_group(mesh_dim))
    return local


def _local_reduction(plan: LocalPlan) -> LocalKernel:
    """The op itself on this rank's piece, or empty outputs for an empty piece (which the op would compute
    while warning about zero degrees of freedom)."""
    op = plan.op

    def kernel(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        return op(x, *args, **kwargs) if x.numel() != 0 else empty_outputs(plan, x)
    return kernel


def _var_kernel(plan: LocalPlan) -> LocalKernel:
    spec = plan.input_specs[0]
    reduced, correction, keepdim = _var_args(plan.schema, spec.ndim)
    sharding = _sharded_mesh_dims(spec, reduced)
    if not sharding:
        return _local_reduction(plan)
    dims = list(reduced)
    count = math.prod(spec.shape[d] for d in reduced)
    is_std, with_mean = plan.op in _STD_OPS, plan.op in _WITH_MEAN_OPS

    def kernel(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        mean = all_reduce_mesh_dims(torch.sum(x, dim=dims, keepdim=True), spec, sharding, ReduceOp.SUM) / count
        deviation = x - mean
        squares = deviation.abs().square() if x.is_complex() else deviation.square()
        var = torch.sum(squares, dim=dims, keepdim=keepdim) / max(count - correction, 0)
        if is_std:
            var = torch.sqrt(all_reduce_mesh_dims(var, spec, sharding, ReduceOp.SUM))
        if with_mean:
            return var, (mean if keepdim else mean.squeeze(dims))
        return var
    return kernel


register_rule(aten.var.correction, aten.std.correction, *_WITH_MEAN_OPS, kernel=_var_kernel)(_var_rule)


# -- vector norms -------------------------------------------------------------------------------------------

def _norm_args(schema: OpSchema, ndim: int) -> tuple[float, tuple[int, ...], bool]:
    args, kwargs = schema.args, schema.kwargs
    order = float(args[1]) if len(args) > 1 else float(kwargs.get("ord", 2))
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = bool(args[3]) if len(args) > 3 else bool(kwargs.get("keepdim", False))
    return order, reduction_dims(dims, ndim), keepdim


def _norm_partial_op(order: float) -> str:
    return "max" if order == math.inf else "min" if order == -math.inf else "sum"


def _norm_rule(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    order, reduced, keepdim = _norm_args(schema, spec.ndim)
    decision = pick_per_mesh_dim(schema, reduction_strategies(spec, reduced, keepdim, _norm_partial_op(order)))
    out = tuple(decision.output_placements)
    stays_partial = order in (0.0, 1.0, math.inf, -math.inf)     # see Note: reducing over a sharded dim
    return ShardingDecision(out if stays_partial else _without_partial(out), decision.input_placements)


def _norm_kernel(plan: LocalPlan) -> LocalKernel:
    spec = plan.input_specs[0]
    order, reduced, keepdim = _norm_args(plan.schema, spec.ndim)
    sharding = _sharded_mesh_dims(spec, reduced)
    if not sharding:
        return plan.op
    dims, out_spec = list(reduced), plan.output_specs[0]

    def kernel(x: Tensor, *args: Any, dtype: torch.dtype | None = None) -> Tensor:
        magnitude = (x if dtype is None else x.to(dtype)).abs()
        if order in (math.inf, -math.inf):
            if magnitude.numel() == 0:      # an empty shard: the identity of max/min over magnitudes
                return magnitude.new_full(out_spec.local_shape(), 0.0 if order == math.inf else math.inf)
            return torch.amax(magnitude, dims, keepdim) if order > 0 else torch.amin(magnitude, dims, keepdim)
        if order == 0.0:
            return torch.sum(magnitude != 0, dim=dims, keepdim=keepdim, dtype=magnitude.dtype)
        if order == 1.0:
            return torch.sum(magnitude, dim=dims, keepdim=keepdim)
        # each shard's norm as torch computes a tensor's, then its p-th power (torch's sharded numerics: a
        # gradient norm logged under FSDP reads as torch's)
        power_sum = torch.linalg.vector_norm(magnitude, order, dim=dims, keepdim=keepdim).pow(order)
        return all_reduce_mesh_dims(power_sum, spec, sharding, ReduceOp.SUM).pow(1.0 / order)
    return kernel


register_rule(aten.linalg_vector_norm.default, kernel=_norm_kernel)(_norm_rule)
