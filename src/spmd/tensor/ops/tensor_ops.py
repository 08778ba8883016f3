"""Sharding rules for tensor factories and fills on DTensors: *_like, new_*, fill_, zero_, and the ops that
read values out (.item(), torch.equal, is_same_size).

Layer: tensor. Decisions, plus handlers for the value-reading ops.
"""

from __future__ import annotations

from typing import Any

from torch import ops
from torch._ops import OpOverload

from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import local_as
from spmd.tensor.placement import Partial, Replicate
from spmd.tensor.rules import OpSchema, ShardingDecision, ShardingError, register_handler, register_rule, replicated
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


@register_rule(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)
def _like(schema: OpSchema) -> ShardingDecision:
    """A fresh tensor shaped like the input: same shards; a Partial input gives a Replicate output (the new value
    is the same on every rank). No communication."""
    spec = schema.input_specs[0]
    return ShardingDecision(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements))


@register_rule(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
               aten.new_empty_strided.default)
def _new(schema: OpSchema) -> ShardingDecision:
    """x.new_*(size): a fresh full-size tensor of the given (global) size on every rank: Replicate."""
    return ShardingDecision(replicated(schema.mesh))


@register_rule(aten.zero_.default)
def _zero(schema: OpSchema) -> ShardingDecision:
    """Zeros are zeros in every layout (a Partial of zeros reduces to zero for every op but product, where any
    zero term gives zero too)."""
    return ShardingDecision(schema.input_specs[0].placements)


def _partitioned_scalar(spec: DTensorSpec, value: Any) -> Any:
    """This rank's share of a scalar filled into a Partial tensor, so that the reduction gives `value` back."""
    coordinate = spec.mesh.get_coordinate() or []
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, Partial) and coordinate and coordinate[mesh_dim] != 0:
            if placement.reduce_op in ("sum", "bxor"):
                return 0
            if placement.reduce_op == "product":
                return 1
    return value


@register_rule(aten.fill_.Scalar)
def _fill_scalar(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    return ShardingDecision(spec.placements, local_args=(spec, _partitioned_scalar(spec, schema.args[1])))


@register_rule(aten.fill_.Tensor)
def _fill_tensor(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    if spec.has_partial():
        raise ShardingError("fill_ with a tensor value into a Partial tensor; pass a Python number or "
                            "redistribute the tensor to Replicate first")
    others = [replicated(schema.mesh)] * (len(schema.input_specs) - 1)
    return ShardingDecision(spec.placements, [None, *others])


@register_handler(aten._local_scalar_dense.default)
def _item(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """.item(): the reduced, gathered value (collective when the tensor is sharded or Partial)."""
    tensor = args[0]
    return op(local_as(tensor, replicated(tensor._spec.mesh)))


@register_handler(aten.equal.default)
def _equal(op: OpOverload, args: tuple, kwargs: dict) -> bool:
    """torch.equal on the global values (collective: both are gathered)."""
    a, b = args
    if a.shape != b.shape:
        return False
    full = [local_as(t, replicated(t._spec.mesh)) if isinstance(t, DTensor) else t for t in (a, b)]
    return bool(op(*full))


@register_handler(aten.is_same_size.default)
def _is_same_size(op: OpOverload, args: tuple, kwargs: dict) -> bool:
    return args[0].shape == args[1].shape
