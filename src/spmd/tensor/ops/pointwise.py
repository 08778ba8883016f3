"""Sharding rules for pointwise ops: every op tagged torch.Tag.pointwise, plus copy_ and _to_copy.

Layer: tensor. Decisions only.

The output follows the inputs: on each mesh dim the candidates are the placements the inputs already have
(mapped through broadcasting: a Shard of an input dim becomes the same kind of Shard of the matching output dim;
an input broadcast along the output dim must be Replicate there), then Replicate. In-place ops keep self's placement.
Partial survives only where the op is linear in the Partial operand (see Note: pointwise ops and Partial).
"""

from __future__ import annotations

import torch
from torch import Tensor, ops
from torch._ops import OpOverload

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import (
    OpSchema,
    ShardingDecision,
    Strategy,
    pick_per_mesh_dim,
    register_family,
    register_rule,
)
from spmd.tensor.spec import DTensorSpec

aten = ops.aten

# Note: pointwise ops and Partial
# A Partial(sum/avg) value is a sum of per-rank terms, so an op may keep it Partial only if it is linear in it:
# - additive ops (add, sub): every tensor operand Partial (a Replicate operand is partitioned locally, exactly:
#   its value on the first rank, zeros elsewhere); not with a Python-number or plain-tensor operand, which
#   each rank would add once;
# - scaling ops (mul by a Replicate or a number, div of a Partial by one, neg, clone, float->float casts):
#   exactly one operand Partial, the rest Replicate;
# - masked_fill with the value 0: zeroing entries is linear in self (the mask must be Replicate);
# - copy_: the copied value may be Partial (self takes it). Everything else reduces Partial inputs first; an
#   in-place op that is not linear in its Partial self asks for self Replicate, and dispatch all-reduces self in
#   place first (see Note: in-place ops on Partial tensors, in dispatch/run.py).
_ADDITIVE = frozenset({aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor})
_SCALING_ANY = frozenset({aten.mul.Tensor, aten.mul_.Tensor, aten.mul.Scalar, aten.mul_.Scalar})  # any operand
_SCALING_FIRST = frozenset({aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, aten.div_.Scalar, aten.neg.default,
                            aten.neg_.default, aten.clone.default, aten.positive.default, aten._to_copy.default})

_MASKED_FILL = frozenset({aten.masked_fill.Scalar, aten.masked_fill_.Scalar})


def _is_float(dtype: torch.dtype | None) -> bool:
    return dtype is None or dtype.is_floating_point or dtype.is_complex


def _linear_positions(schema: OpSchema) -> tuple[int, ...] | str | None:
    """Which DTensor inputs may carry a Partial through the op: "all" (additive), a tuple of positions (scaling),
    or None (not linear)."""
    op = schema.op
    specs = schema.input_specs
    if op in _ADDITIVE:
        tensor_operands = [a for a in schema.args[:2] if isinstance(a, (DTensorSpec, Tensor))]
        all_dtensors = len(tensor_operands) == 2 and all(isinstance(a, DTensorSpec) for a in tensor_operands)
        return "all" if all_dtensors else None
    if op in _SCALING_ANY:
        return tuple(range(len(specs)))
    if op in _SCALING_FIRST:
        if op is aten._to_copy.default and not (_is_float(specs[0].dtype) and _is_float(schema.kwargs.get("dtype"))):
            return None
        return (0,) if isinstance(schema.args[0], DTensorSpec) else None
    if op in _MASKED_FILL:
        value = schema.args[2] if len(schema.args) > 2 else schema.kwargs.get("value")
        zero = type(value) in (bool, int, float) and value == 0
        return (0,) if zero and isinstance(schema.args[0], DTensorSpec) else None
    if op is aten.copy_.default:
        return (1,) if len(specs) == 2 else None     # see partial_strategies: copy_ is handled on its own
    return None


def _plain_shapes(values: object) -> list[torch.Size]:
    if isinstance(values, Tensor):
        return [values.shape]
    if isinstance(values, (list, tuple)):
        return [shape for value in values for shape in _plain_shapes(value)]
    return []


def _input_dim(spec: DTensorSpec, out_shape: torch.Size, out_dim: int) -> int | None:
    """The input dim that output dim `out_dim` reads without broadcasting, or None."""
    dim = out_dim - (len(out_shape) - spec.ndim)
    if dim < 0 or spec.shape[dim] != out_shape[out_dim]:
        return None
    return dim


def pointwise_rule(schema: OpSchema) -> ShardingDecision:
    """The rule for every pointwise op (see the module docstring)."""
    specs = schema.input_specs
    out_shape = torch.broadcast_shapes(*(s.shape for s in specs), *_plain_shapes(schema.args))
    ndim_out = len(out_shape)
    mutated_self = schema.op._schema.arguments[0].alias_info is not None and \
        schema.op._schema.arguments[0].alias_info.is_write and isinstance(schema.args[0], DTensorSpec)
    linear = _linear_positions(schema)

    def strategy(output: Placement) -> Strategy | None:
        if isinstance(output, Shard):
            inputs = []
            for spec in specs:
                dim = _input_dim(spec, out_shape, output.dim)
                inputs.append(Replicate() if dim is None else output.with_dim(dim))
            return Strategy(tuple(inputs), output)
        if isinstance(output, Partial):
            return None
        return Strategy((Replicate(),) * len(specs), output)

    def partial_strategies(mesh_dim: int) -> list[Strategy]:
        if linear is None:
            return []
        if schema.op is aten.copy_.default:       # self takes the copied value: both Partial, no reduction
            own = specs[0].placements[mesh_dim]
            return [Strategy((own, own), own)] if isinstance(own, Partial) and own.is_linear else []
        found: list[Strategy] = []
        for k, spec in enumerate(specs):
            placement = spec.placements[mesh_dim]
            if not (isinstance(placement, Partial) and placement.is_linear):
                continue
            if linear == "all":
                found.append(Strategy((placement,) * len(specs), placement))
            elif k in linear:
                if mutated_self and k != 0:
                    continue
                inputs = tuple(placement if j == k else Replicate() for j in range(len(specs)))
                found.append(Strategy(inputs, placement))
        return found

    def candidates(mesh_dim: int) -> list[Strategy]:
        if mutated_self:
            own = specs[0].placements[mesh_dim]
            if isinstance(own, Partial):
                kept = [s for s in partial_strategies(mesh_dim) if s.output == own]
                return kept[:1] or [strategy(Replicate())]    # not linear: dispatch reduces self in place
            own_out = own if not isinstance(own, Shard) else own.with_dim(own.dim + ndim_out - specs[0].ndim)
            return [strategy(own_out)]
        found = partial_strategies(mesh_dim)
        for spec in specs:
            placement = spec.placements[mesh_dim]
            if isinstance(placement, Shard) and spec.shape[placement.dim] == out_shape[
                    placement.dim + ndim_out - spec.ndim]:
                found.append(strategy(placement.with_dim(placement.dim + ndim_out - spec.ndim)))
        found.append(strategy(Replicate()))
        return [s for s in found if s is not None]

    return pick_per_mesh_dim(schema, candidates)


def _is_pointwise(op: OpOverload) -> bool:
    """Tagged pointwise, or the in-place form (`masked_fill_`) of an op tagged pointwise."""
    if torch.Tag.pointwise in op.tags:
        return True
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return False
    functional = getattr(getattr(aten, name[:-1], None), op._overloadname, None)
    return isinstance(functional, OpOverload) and torch.Tag.pointwise in functional.tags


# The rule reads a Python number's value only for masked_fill (is it 0?); elsewhere only its type (promotion),
# so the optimizers' step-dependent scalars (Adam's step size, bias corrections) share one decision.
register_family(_is_pointwise, pointwise_rule, numbers_matter=lambda op: op in _MASKED_FILL)
register_rule(aten.copy_.default, aten._to_copy.default)(pointwise_rule)
