"""Sharding rules for tensor factories and fills on DTensors: *_like, new_*, fill_, zero_; scatter, gather, flip
and cumprod/cumsum (met in the backward of max(dim), scatter, gather and prod); and the ops that read values out
(.item(), torch.equal, is_same_size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import ops
from torch._ops import OpOverload
from torch.utils._mode_utils import no_dispatch

from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import local_as
from spmd.tensor.placement import Partial, Replicate, Shard
from spmd.tensor.rules import (
    OpSchema,
    ShardingDecision,
    ShardingError,
    Strategy,
    pick_per_mesh_dim,
    register_handler,
    register_rule,
    register_strategy,
    replicated,
)
from spmd.tensor.spec import DTensorSpec, contiguous_stride

aten = ops.aten


@register_rule(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)
def _like(schema: OpSchema) -> ShardingDecision:
    """A fresh tensor shaped like the input: same shards; a Partial input gives a Replicate output (the new value
    is the same on every rank). No communication."""
    spec = schema.input_specs[0]
    return ShardingDecision(tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements))


@register_rule(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
def _new(schema: OpSchema) -> ShardingDecision:
    """x.new_*(size): a fresh full-size tensor of the given (global) size on every rank: Replicate."""
    return ShardingDecision(replicated(schema.mesh))


def _dense_stride(shape: Sequence[int], like: Sequence[int]) -> list[int]:
    """Dense strides for `shape` with the dims in the memory order of strides `like` (outermost first)."""
    stride = [0] * len(shape)
    step = 1
    for d in sorted(range(len(shape)), key=lambda d: (like[d], -d)):
        stride[d] = step
        step *= max(shape[d], 1)
    return stride


@register_rule(aten.new_empty_strided.default)
def _new_empty_strided(schema: OpSchema) -> ShardingDecision:
    """x.new_empty_strided(size, stride): laid out like x when `size` is x's global size (AccumulateGrad
    re-strides gradients through it: a sharded gradient stays sharded, with no all-gather); else Replicate.
    The local tensor gets x's local size, with its dims in the requested memory order."""
    spec = schema.input_specs[0]
    size, stride = list(schema.args[1]), list(schema.args[2])
    if size != list(spec.shape):
        return ShardingDecision(replicated(schema.mesh))
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    local = list(DTensorSpec(spec.mesh, placements, spec.shape, spec.stride, spec.dtype).local_shape())
    return ShardingDecision(placements, local_args=(spec, local, _dense_stride(local, stride)))


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _shard_strategies(schema: OpSchema, keep: Callable[[int], bool], partial: bool) -> list[Strategy]:
    """Every DTensor input Shard(d) alike, for each dim d with `keep(d)` and the same size in every input; all
    Partial when `partial` (the op is linear in them); all Replicate."""
    specs = schema.input_specs
    ndim = specs[0].ndim
    found = [Strategy((Shard(d),) * len(specs), Shard(d)) for d in range(ndim)
             if keep(d) and all(s.ndim == ndim and s.shape[d] == specs[0].shape[d] for s in specs)]
    if partial:
        found.append(Strategy((Partial(),) * len(specs), Partial()))
    found.append(Strategy((Replicate(),) * len(specs), Replicate()))
    return found


def _in_place(schema: OpSchema, strategies: list[Strategy]) -> Callable[[int], list[Strategy]]:
    """For an op writing its first input: on each mesh dim the strategy keeping self's placement, else Replicate
    (dispatch all-reduces a Partial self in place; any other move of self is refused)."""
    own = schema.input_specs[0].placements

    def candidates(mesh_dim: int) -> list[Strategy]:
        kept = [s for s in strategies if s.inputs[0] == own[mesh_dim]]
        return kept[:1] or strategies[-1:]
    return candidates


@register_rule(aten.scatter.src, aten.scatter_.src, aten.scatter.value, aten.scatter_.value, aten.scatter_add.default,
               aten.scatter_add_.default)
def _scatter(schema: OpSchema) -> ShardingDecision:
    """self.scatter(dim, index, src) and scatter_add (gather's backward): dims other than `dim` may stay sharded
    where self, index and src have the same size (max(dim)'s backward scatters a gradient into zeros so); `dim`
    itself is gathered. Linear in (self, src) jointly: both Partial with index Replicate keeps Partial (a
    scattered Python value: only 0)."""
    spec = schema.input_specs[0]
    dim = _norm(schema.args[1], max(spec.ndim, 1))
    value = schema.args[3] if len(schema.args) > 3 else schema.kwargs.get("src", schema.kwargs.get("value"))
    linear = isinstance(value, DTensorSpec) or (type(value) in (bool, int, float) and value == 0)
    strategies = _shard_strategies(schema, lambda d: d != dim, partial=False)
    if linear:
        positions = [k for k, arg in enumerate(schema.args) if isinstance(arg, DTensorSpec)]
        inputs = tuple(Replicate() if positions[j] == 2 else Partial() for j in range(len(positions)))
        strategies.insert(-1, Strategy(inputs, Partial()))
    if schema.op in (aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default):
        return pick_per_mesh_dim(schema, _in_place(schema, strategies))
    return pick_per_mesh_dim(schema, strategies)


@register_rule(aten.gather.default)
def _gather(schema: OpSchema) -> ShardingDecision:
    """self.gather(dim, index) (scatter's backward): dims other than `dim` may stay sharded where self and index
    have the same size; `dim` is gathered. Linear in self: Partial self with index Replicate stays Partial."""
    dim = _norm(schema.args[1], max(schema.input_specs[0].ndim, 1))
    strategies = _shard_strategies(schema, lambda d: d != dim, partial=False)
    if isinstance(schema.args[0], DTensorSpec):
        inputs = (Partial(),) + (Replicate(),) * (len(schema.input_specs) - 1)
        strategies.insert(-1, Strategy(inputs, Partial()))
    return pick_per_mesh_dim(schema, strategies)


@register_strategy(aten.flip.default)
def _flip(schema: OpSchema) -> list[Strategy]:
    """flip(dims): the other dims keep their shards; a flipped sharded dim is gathered (reversed chunks are not
    torch.chunk pieces). Linear: Partial stays."""
    ndim = schema.input_specs[0].ndim
    flipped = {_norm(d, max(ndim, 1)) for d in schema.args[1]}
    return _shard_strategies(schema, lambda d: d not in flipped, partial=True)


@register_strategy(aten.cumprod.default, aten.cumsum.default)
def _cumulative(schema: OpSchema) -> list[Strategy]:
    """cumprod/cumsum(dim) (cumsum is in cumprod's backward): the other dims keep their shards; `dim` is
    gathered; cumsum is linear (Partial stays), cumprod is not (Partial is reduced)."""
    dim = _norm(schema.args[1], max(schema.input_specs[0].ndim, 1))
    return _shard_strategies(schema, lambda d: d != dim, partial=schema.op is aten.cumsum.default)


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


@register_handler(aten.resize_.default, aten.resize_as_.default)
def _resize_(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """x.resize_(size): a replicated DTensor resizes its local tensor and its wrapper (its data stays where it is,
    as a plain tensor's); a sharded or Partial one only to its own size (which shard would the new elements be
    in?): anything else is refused."""
    self = args[0]
    size = torch.Size(args[1].shape if op is aten.resize_as_.default else args[1])
    spec = self._spec
    if size == spec.shape:
        return self
    if not all(isinstance(p, Replicate) for p in spec.placements):
        raise ShardingError(f"spmd DTensor: {op} on rank {spec.mesh.get_rank()} of a {list(spec.placements)} "
                            f"DTensor of shape {tuple(spec.shape)} to {tuple(size)}: only a replicated DTensor "
                            f"resizes; redistribute it to Replicate first")
    self._local_tensor.resize_(size)
    with no_dispatch():
        torch.Tensor.resize_(self, size)
    self._spec = DTensorSpec(spec.mesh, spec.placements, size, contiguous_stride(size), spec.dtype)
    return self


@register_handler(aten.is_same_size.default)
def _is_same_size(op: OpOverload, args: tuple, kwargs: dict) -> bool:
    return args[0].shape == args[1].shape
