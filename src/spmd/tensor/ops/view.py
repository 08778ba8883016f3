"""Sharding rules for views and shape ops: view/reshape/flatten/unflatten, transpose/permute/t, (un)squeeze,
expand, split/chunk/unbind, cat/stack, slice/select/narrow/indexing, alias/detach, and their backward ops; the
in-place views (squeeze_, unsqueeze_, transpose_, t_, as_strided_), whose new shape dispatch gives the wrapper.

Layer: tensor. Decisions only.

A view maps each input dim to an output dim (or to none). A Shard of an input dim survives as a Shard of its
output dim when the local pieces are still torch.chunk pieces of that output dim; otherwise that mesh dim is
gathered first (Replicate). Partial passes through every op here: they are all linear. Ops whose size
arguments are global (view, expand, the *_backward ops) get the LOCAL sizes in `local_args`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import ops

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import (
    OpSchema,
    ShardingDecision,
    ShardingError,
    Strategy,
    pick_per_mesh_dim,
    register_handler,
    register_rule,
)
from spmd.tensor.spec import DTensorSpec, Placements, contiguous_stride

aten = ops.aten

DimMap = Callable[[int], int | None]


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _map_placements(spec: DTensorSpec, mapping: DimMap) -> tuple[Placements, Placements]:
    """(input placements needed, output placements): Shards of unmapped dims are gathered; the rest follow."""
    needed: list[Placement] = []
    out: list[Placement] = []
    for placement in spec.placements:
        if isinstance(placement, Shard):
            dim = mapping(placement.dim)
            if dim is None:
                needed.append(Replicate())
                out.append(Replicate())
                continue
            needed.append(placement)
            out.append(placement.with_dim(dim))
        else:
            needed.append(placement)
            out.append(placement)
    return tuple(needed), tuple(out)


def _decide(schema: OpSchema, mapping: DimMap, local_args: Callable[[Placements], tuple] | None = None
            ) -> ShardingDecision:
    spec = schema.input_specs[0]
    needed, out = _map_placements(spec, mapping)
    others = [None] * (len(schema.input_specs) - 1)
    return ShardingDecision(out, [needed, *others], None if local_args is None else local_args(out))


def _local_shape(spec: DTensorSpec, placements: Placements, shape: Sequence[int]) -> list[int]:
    """This rank's local shape of a tensor of global `shape` laid out as `placements` on spec's mesh."""
    out_spec = DTensorSpec(spec.mesh, placements, torch.Size(shape), contiguous_stride(shape), spec.dtype)
    return list(out_spec.local_shape())


# -- view / reshape -----------------------------------------------------------------------------------------

def _infer_size(shape: Sequence[int], numel: int) -> list[int]:
    shape = list(shape)
    if -1 in shape:
        known = 1
        for size in shape:
            if size != -1:
                known *= size
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def _view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split the dims into groups of input dims and output dims with equal products (a view maps group to group)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        ins, outs = [i], [j]
        p_in, p_out = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while p_in != p_out and (i < len(in_shape) or j < len(out_shape)):
            if (p_in < p_out and i < len(in_shape)) or j >= len(out_shape):
                ins.append(i)
                p_in *= in_shape[i]
                i += 1
            else:
                outs.append(j)
                p_out *= out_shape[j]
                j += 1
        groups.append((ins, outs))
    if groups:
        groups[-1][0].extend(range(i, len(in_shape)))
        groups[-1][1].extend(range(j, len(out_shape)))
    return groups


def _view_mapping(spec: DTensorSpec, out_shape: Sequence[int]) -> DimMap:
    in_shape = list(spec.shape)
    group_of = {}
    for ins, outs in _view_groups(in_shape, out_shape):
        for d in ins:
            group_of[d] = (ins, outs)

    def mapping(dim: int) -> int | None:
        if dim not in group_of:
            return None
        ins, outs = group_of[dim]
        lead_in = next((d for d in ins if in_shape[d] != 1), None)
        lead_out = next((d for d in outs if out_shape[d] != 1), None)
        if lead_in != dim or lead_out is None:
            return None
        if sum(in_shape[d] != 1 for d in ins) == 1 and sum(out_shape[d] != 1 for d in outs) == 1:
            return lead_out        # the same dim, renamed: uneven shards stay valid
        shards = spec.num_shards(dim)
        return lead_out if in_shape[dim] % shards == 0 and out_shape[lead_out] % shards == 0 else None

    return mapping


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    out_shape = _infer_size(schema.args[1], math.prod(spec.shape))
    return _decide(schema, _view_mapping(spec, out_shape),
                   lambda out: (spec, _local_shape(spec, out, out_shape)))


# -- dim permutations ---------------------------------------------------------------------------------------

@register_rule(aten.transpose.int, aten.transpose_.default)
def _transpose(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    if spec.ndim == 0:
        return _decide(schema, lambda d: d)
    d0, d1 = _norm(schema.args[1], spec.ndim), _norm(schema.args[2], spec.ndim)
    return _decide(schema, lambda d: d1 if d == d0 else d0 if d == d1 else d)


@register_rule(aten.t.default, aten.t_.default)
def _t(schema: OpSchema) -> ShardingDecision:
    ndim = schema.input_specs[0].ndim
    return _decide(schema, lambda d: d if ndim < 2 else 1 - d)


@register_rule(aten.permute.default)
def _permute(schema: OpSchema) -> ShardingDecision:
    ndim = schema.input_specs[0].ndim
    order = [_norm(d, ndim) for d in schema.args[1]]
    return _decide(schema, lambda d: order.index(d))


@register_rule(aten.alias.default, aten.detach.default, aten.lift_fresh.default)
def _identity(schema: OpSchema) -> ShardingDecision:
    return _decide(schema, lambda d: d)


# -- squeeze / unsqueeze / expand ---------------------------------------------------------------------------

@register_rule(aten.unsqueeze.default, aten.unsqueeze_.default)
def _unsqueeze(schema: OpSchema) -> ShardingDecision:
    dim = _norm(schema.args[1], schema.input_specs[0].ndim + 1)
    return _decide(schema, lambda d: d + (d >= dim))


@register_handler(aten.squeeze.default, aten.squeeze.dim, aten.squeeze_.default, aten.squeeze_.dim)
def _squeeze_to_dims(op: object, args: tuple, kwargs: dict) -> object:
    """squeeze() and squeeze(dim) act on LOCAL size-1 dims; re-issue as squeeze.dims of the GLOBAL size-1 dims
    (in place for squeeze_)."""
    tensor = args[0]
    dims = list(range(tensor.ndim)) if len(args) < 2 else [_norm(args[1], max(tensor.ndim, 1))]
    in_place = op in (aten.squeeze_.default, aten.squeeze_.dim)
    return (aten.squeeze_.dims if in_place else aten.squeeze.dims)(tensor, dims)


@register_rule(aten.squeeze.dims, aten.squeeze_.dims)
def _squeeze_dims(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    ndim = spec.ndim
    dims = sorted({_norm(d, max(ndim, 1)) for d in schema.args[1] if ndim and spec.shape[_norm(d, ndim)] == 1})

    def mapping(d: int) -> int | None:
        return None if d in dims else d - sum(1 for s in dims if s < d)

    return _decide(schema, mapping, lambda out: (spec, dims))


@register_rule(aten.as_strided_.default)
def _as_strided_(schema: OpSchema) -> ShardingDecision:
    """x.as_strided_(size, stride, offset) reads x's storage, which only a replica (or a Partial term) holds
    whole; a sharded tensor has no global storage to re-stride."""
    spec = schema.input_specs[0]
    if any(isinstance(p, Shard) for p in spec.placements):
        raise ShardingError("as_strided_ on a sharded DTensor: its storage is split over the ranks; redistribute "
                            "it to Replicate first, or use view/transpose ops")
    return ShardingDecision(spec.placements)


@register_rule(aten.diagonal.default)
def _diagonal(schema: OpSchema) -> ShardingDecision:
    """diagonal(x, offset, dim1, dim2): the two dims go (their shards are gathered), the diagonal is the last
    output dim; the other dims keep their shards, renumbered."""
    spec = schema.input_specs[0]
    args = [*schema.args[1:], *[None] * 3]
    dim1 = args[1] if args[1] is not None else schema.kwargs.get("dim1", 0)
    dim2 = args[2] if args[2] is not None else schema.kwargs.get("dim2", 1)
    d1, d2 = _norm(dim1, spec.ndim), _norm(dim2, spec.ndim)
    return _decide(schema, lambda d: None if d in (d1, d2) else d - (d > d1) - (d > d2))


@register_rule(aten.unfold.default)
def _unfold(schema: OpSchema) -> ShardingDecision:
    """x.unfold(dim, size, step): windows along `dim` (its shards are gathered) in a new last dim; the other dims
    keep their shards."""
    spec = schema.input_specs[0]
    dim = _norm(schema.args[1], max(spec.ndim, 1))
    return _decide(schema, lambda d: None if d == dim else d)


@register_rule(aten.view.dtype)
def _view_dtype(schema: OpSchema) -> ShardingDecision:
    """x.view(dtype): the same bits read as another dtype. Not linear, so a Partial is reduced first; a dtype of
    another size rescales the last dim, whose shards are gathered; the other dims keep theirs."""
    spec = schema.input_specs[0]
    same_size = schema.args[1].itemsize == spec.dtype.itemsize
    needed, out = _map_placements(spec, lambda d: d if same_size or d != spec.ndim - 1 else None)

    def reduced(placements: Placements) -> Placements:
        return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)

    return ShardingDecision(reduced(out), [reduced(needed)])


@register_rule(aten.view_as_complex.default)
def _view_as_complex(schema: OpSchema) -> ShardingDecision:
    """(..., 2) real pairs read as (...) complex numbers (RoPE's rotation): the pair dim is gathered, the other
    dims keep their shards, a Partial stays one (the view is linear)."""
    last = schema.input_specs[0].ndim - 1
    return _decide(schema, lambda d: d if d < last else None)


@register_rule(aten.view_as_real.default)
def _view_as_real(schema: OpSchema) -> ShardingDecision:
    """Complex numbers read as (..., 2) real pairs: every dim keeps its shards, a Partial stays one (linear)."""
    return _decide(schema, lambda d: d)


@register_handler(aten._conj.default)
def _conjugate(op: object, args: tuple, kwargs: dict) -> object:
    """The conjugate (autograd's backward of a complex multiply takes it) made as values, conj_physical, which
    keeps every shard and Partial: a DTensor can't carry the conjugate bit of torch's lazy conjugate view."""
    return torch.conj_physical(args[0])


@register_rule(aten.expand.default)
def _expand(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    sizes = list(schema.args[1])
    lead = len(sizes) - spec.ndim
    out_shape = [spec.shape[i - lead] if s == -1 else s for i, s in enumerate(sizes)]

    def mapping(d: int) -> int | None:
        return d + lead if spec.shape[d] == out_shape[d + lead] else None

    return _decide(schema, mapping, lambda out: (spec, _local_shape(spec, out, out_shape)))


# -- split / unbind / slice / select ------------------------------------------------------------------------

def _except_dim(schema: OpSchema, dim_arg: int, removes: bool) -> ShardingDecision:
    spec = schema.input_specs[0]
    raw = schema.args[dim_arg] if len(schema.args) > dim_arg else schema.kwargs.get("dim", 0)
    dim = _norm(raw if raw is not None else 0, max(spec.ndim, 1))
    if removes:
        return _decide(schema, lambda d: None if d == dim else d - (d > dim))
    return _decide(schema, lambda d: None if d == dim else d)


@register_rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(schema: OpSchema) -> ShardingDecision:
    return _except_dim(schema, 2, removes=False)


@register_rule(aten.slice.Tensor)
def _slice(schema: OpSchema) -> ShardingDecision:
    return _except_dim(schema, 1, removes=False)


@register_rule(aten.unbind.int)
def _unbind(schema: OpSchema) -> ShardingDecision:
    return _except_dim(schema, 1, removes=True)


@register_rule(aten.select.int)
def _select(schema: OpSchema) -> ShardingDecision:
    return _except_dim(schema, 1, removes=True)


@register_rule(aten.select_backward.default)
def _select_backward(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    _, input_sizes, dim, index = schema.args
    dim = _norm(dim, len(input_sizes))
    return _decide(schema, lambda d: d + (d >= dim),
                   lambda out: (spec, _local_shape(spec, out, input_sizes), dim, index))


@register_rule(aten.slice_backward.default)
def _slice_backward(schema: OpSchema) -> ShardingDecision:
    spec = schema.input_specs[0]
    _, input_sizes, dim, start, end, step = schema.args
    dim = _norm(dim, len(input_sizes))
    return _decide(schema, lambda d: None if d == dim else d,
                   lambda out: (spec, _local_shape(spec, out, input_sizes), dim, start, end, step))


# -- cat / stack --------------------------------------------------------------------------------------------

def _join_strategies(schema: OpSchema, dim: int, shift: Callable[[int], int | None]) -> Callable[[int],
                                                                                                    list[Strategy]]:
    specs = schema.input_specs

    def candidates(mesh_dim: int) -> list[Strategy]:
        found: list[Strategy] = []
        for spec in specs:
            placement = spec.placements[mesh_dim]
            if isinstance(placement, Shard) and shift(placement.dim) is not None:
                found.append(Strategy((placement,) * len(specs), Shard(shift(placement.dim))))
            elif isinstance(placement, Partial) and placement.is_linear:
                found.append(Strategy((placement,) * len(specs), placement))
        found.append(Strategy((Replicate(),) * len(specs), Replicate()))
        return found

    return candidates


@register_rule(aten.cat.default)
def _cat(schema: OpSchema) -> ShardingDecision:
    specs = schema.input_specs
    tensors = schema.args[0]
    if any(not isinstance(t, DTensorSpec) for t in tensors):
        raise ShardingError("cat mixes DTensors with plain tensors; make every input a DTensor")
    ndim = max(s.ndim for s in specs)
    if any(s.ndim != ndim for s in specs):
        raise ShardingError("cat of DTensors with different numbers of dims is not supported")
    raw = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", 0)
    dim = _norm(raw, ndim)
    return pick_per_mesh_dim(schema, _join_strategies(schema, dim, lambda d: None if d == dim else d))


@register_rule(aten.stack.default)
def _stack(schema: OpSchema) -> ShardingDecision:
    specs = schema.input_specs
    if any(not isinstance(t, DTensorSpec) for t in schema.args[0]):
        raise ShardingError("stack mixes DTensors with plain tensors; make every input a DTensor")
    raw = schema.args[1] if len(schema.args) > 1 else schema.kwargs.get("dim", 0)
    dim = _norm(raw, specs[0].ndim + 1)
    return pick_per_mesh_dim(schema, _join_strategies(schema, dim, lambda d: d + (d >= dim)))


# -- advanced indexing --------------------------------------------------------------------------------------

@register_rule(aten.index.Tensor)
def _index(schema: OpSchema) -> ShardingDecision:
    """x[idx...]: indexed dims and the index tensors are replicated; the other dims keep their shards."""
    spec = schema.input_specs[0]
    indices = list(schema.args[1])
    if any(index is not None and index.dtype in (torch.bool, torch.uint8) for index in indices):
        raise ShardingError("indexing with a boolean mask gives a shape that depends on the mask's values, which "
                            "no rank knows before the others' are counted; select on the full tensor "
                            "(x.full_tensor()[mask.full_tensor()]) or keep the shape with torch.where / masked_fill")
    indexed = [d for d, index in enumerate(indices) if index is not None]
    index_shapes = [index.shape for index in indices if index is not None]
    index_ndim = len(torch.broadcast_shapes(*index_shapes)) if index_shapes else 0
    consecutive = indexed == list(range(indexed[0], indexed[-1] + 1)) if indexed else True
    rest = [d for d in range(spec.ndim) if d not in indexed]

    def mapping(d: int) -> int | None:
        if d in indexed:
            return None
        if consecutive and indexed:
            return d if d < indexed[0] else d - len(indexed) + index_ndim
        return index_ndim + rest.index(d)

    needed, out = _map_placements(spec, mapping)
    others = [tuple(Replicate() for _ in range(spec.mesh.ndim))] * (len(schema.input_specs) - 1)
    return ShardingDecision(out, [needed, *others])
