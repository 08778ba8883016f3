"""Sharding rules for the `_foreach_*` and fused optimizer ops, so torch.optim steps on DTensor parameters.

Layer: tensor. The elementwise `_foreach_*` ops get one rule, registered so that a Partial operand keeps the
layout it was reduced to; `_foreach_norm` / `_foreach_max` are lists of the reduction handlers;
the fused optimizer kernels (`_fused_adam_`, `_fused_adamw_`, `_fused_sgd_`, `_fused_adagrad_`) are handlers
that run the kernel on the local shards.

Note: foreach ops position by position
A foreach op is the same elementwise op applied at every list position i to (self[i], other[i], ...). Each
position is decided on its own, following self[i] (the parameter, or the optimizer state laid out like it):
every other tensor at position i is redistributed to self[i]'s placements, and out-of-place results take
them. That is what an optimizer needs: params, grads and states line up per parameter, whatever each
parameter's layout is. A Partial operand is reduced to self's layout (all-reduce to Replicate,
reduce-scatter to Shard), so a Partial gradient is never read unreduced. A Partial self[i] (a momentum
buffer cloned from a Partial gradient) stays Partial through the ops linear in it (see `_PARTIAL_ROLES`): its
"follow" operands become the same Partial, its "scale" operands Replicate. Other ops on a Partial self reduce
it first (out of place) or are refused (in place: a written tensor keeps its layout).

Note: batched foreach norms
`_foreach_norm` (clip_grad_norm_) needs every gradient's norm. One all-reduce per gradient would be hundreds
of tiny collectives, so the gradients sharded over the same mesh dims are done together: each rank stacks
its local sums of |x|^p (or local max |x| for p = inf), ONE all-reduce over the sharding mesh dims sums (maxes)
the stack, and ^(1/p) gives every norm, Replicate. Partial gradients, p = 0 and p = -inf take the per-tensor
norm rule.

Note: Partial operands are reduced once
An optimizer reads each gradient in several foreach ops (Adam: lerp_, then addcmul_ with it twice). Were a
Partial gradient reduced by each op's redistribution, it would be all-reduced three times per step. So a
Partial operand that a foreach op reduces keeps the result IN PLACE (the rule's adopt_reduced_partials): the
DTensor keeps its global value and takes the reduced layout, and the later ops find it reduced. Only Partial
operands are changed this way (their reduced layout is never bigger); other mismatches are redistributed per
call. An operand passed twice to one op (addcmul_'s tensor1 and tensor2) is moved once.

Note: fused optimizer kernels and gradient layouts
`_fused_adam_` and friends write every list in place, gradients included (they unscale them), so dispatch
can't redistribute a gradient for them. Their handler first brings each gradient (and state) to its
parameter's layout IN PLACE: the DTensor object keeps its global value and gets the parameter's placements
(a Partial gradient is reduced once, here, and stays reduced). Then the kernel runs on the local shards,
which are elementwise-aligned.

Note: GradScaler on sharded gradients
`torch.amp.GradScaler` unscales the gradients with `_amp_foreach_non_finite_check_and_unscale_(grads,
found_inf, inv_scale)`, then skips the optimizer step if `found_inf` (a plain one-element tensor, written in
place) is nonzero. On DTensor gradients each rank unscales its own shard, so it sees only its own infs; its
kernel then all-reduces `found_inf` with MAX over the whole mesh, so that every rank skips the step when any
shard had an inf or NaN (torch's ShardedGradScaler does the same). The whole mesh, not only the mesh dims the
gradients are sharded over: a replica that went wrong on one rank must stop every rank too. That is ONE
all-reduce where a group of all the mesh's ranks exists (a 1-d mesh, a mesh over the whole world, a flattened
mesh: DeviceMesh.existing_group), else one per mesh dim of size > 1. A Partial gradient is reduced (in place,
to Replicate) first: its partial terms could be finite where their sum is not, or the reverse. `inv_scale`
and `found_inf` are plain one-element tensors, which dispatch passes to the kernel as they are (a DTensor one
is made Replicate).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, ops
from torch._ops import OpOverload

from spmd.comm.collectives import all_reduce
from spmd.comm.functional import all_reduced
from spmd.comm.reduce_op import ReduceOp
from spmd.tensor.api import DTensor
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import (
    LocalKernel,
    LocalPlan,
    OpSchema,
    ShardingDecision,
    ShardingError,
    register_handler,
    register_rule,
    replicated,
)
from spmd.tensor.spec import DTensorSpec, Placements

aten = ops.aten

# Arguments of the ops linear in self, by role (see Note: foreach ops position by position):
# "follow" operands are summed with self (they take self's Partial), "scale" operands multiply it (Replicate).
# Overloads with a Python-number or one-tensor addend (add.Scalar, sub.Tensor, ...) are not linear.
_PARTIAL_ROLES: dict[str, dict[str, str]] = {
    "add.List": {"other": "follow"}, "sub.List": {"other": "follow"},
    "mul": {"other": "scale", "scalar": "scale", "scalars": "scale"},
    "div": {"other": "scale", "scalar": "scale", "scalars": "scale"},
    "lerp": {"tensors1": "follow", "weights": "scale", "weight": "scale"},
    "addcmul": {"tensor1": "follow", "tensor2": "scale", "scalars": "scale", "value": "scale"},
    "addcdiv": {"tensor1": "follow", "tensor2": "scale", "scalars": "scale", "value": "scale"},
    "neg": {}, "zero": {}, "clone": {}, "copy": {"src": "follow"},
}

_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max", "_foreach_powsum", "_foreach_mm"})
_FUSED = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")


def _partial_roles(op: OpOverload) -> dict[str, str] | None:
    """The roles of `op`'s operands if it is linear in self (`_foreach_add_.List` looks up "add.List", then
    "add"), else None."""
    name = op._schema.name.removeprefix("aten::_foreach_").rstrip("_")
    exact = _PARTIAL_ROLES.get(f"{name}.{op._overloadname}")
    if exact is not None or name in ("add", "sub"):
        return exact
    return _PARTIAL_ROLES.get(name)


def _entries(schema: OpSchema) -> Iterator[tuple[str, int | None]]:
    """(argument name, list position or None) of every DTensor input, in input_specs order."""
    names = [a.name for a in schema.op._schema.arguments]
    for index, value in enumerate(schema.args):
        yield from _walk(names[index], value)
    for name, value in schema.kwargs.items():
        yield from _walk(name, value)


def _walk(name: str, value: Any) -> Iterator[tuple[str, int | None]]:
    if isinstance(value, DTensorSpec):
        yield name, None
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            if isinstance(item, DTensorSpec):
                yield name, position


def _lead_name(schema: OpSchema) -> str:
    """The list the op is applied along: `self`, or the first list argument (`_foreach_pow.ScalarAndTensor`)."""
    for argument, value in zip(schema.op._schema.arguments, schema.args):
        if isinstance(value, (list, tuple)):
            return argument.name
    raise ShardingError("a foreach op without a list argument")


def _position_plan(lead: DTensorSpec, roles: dict[str, str] | None, in_place: bool,
                   mesh_ndim: int) -> tuple[Placements, dict[str, Placements]]:
    """Placements of the lead tensor and of each role's operands at one position (lead kept when in place)."""
    lead_target: list[Placement] = []
    follow: list[Placement] = []
    scale: list[Placement] = []
    for mesh_dim in range(mesh_ndim):
        own = lead.placements[mesh_dim]
        if isinstance(own, Partial):
            if roles is not None and own.is_linear:
                lead_target.append(own)
                follow.append(own)
                scale.append(Replicate())
                continue
            if in_place:
                raise ShardingError(f"the op writes a Partial({own.reduce_op!r}) tensor in place but is not linear "
                                    f"in it; redistribute it to Replicate or Shard first")
            own = Replicate()
        lead_target.append(own)
        follow.append(own)
        scale.append(own)
    return tuple(lead_target), {"follow": tuple(follow), "scale": tuple(scale)}


def foreach_rule(schema: OpSchema) -> ShardingDecision:
    """The rule for every elementwise foreach op (see Note: foreach ops position by position)."""
    op = schema.op
    mesh_ndim = schema.mesh.ndim
    lead_name = _lead_name(schema)
    entries = list(_entries(schema))
    in_place = any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
                   if a.name == lead_name)
    roles = _partial_roles(op)
    leads: dict[int, DTensorSpec] = {}
    for spec, (name, position) in zip(schema.input_specs, entries):
        if name == lead_name and position is not None:
            leads[position] = spec
    plans = {position: _position_plan(spec, roles, in_place, mesh_ndim) for position, spec in leads.items()}
    input_placements: list[Placements | None] = []
    for name, position in entries:
        if position is None or position not in plans:       # a one-tensor operand (a scale factor): Replicate
            input_placements.append((Replicate(),) * mesh_ndim)
            continue
        lead_target, by_role = plans[position]
        if name == lead_name:
            input_placements.append(lead_target)
        else:
            role = (roles or {}).get(name, "scale")
            input_placements.append(by_role[role])
    if in_place or not op._schema.returns:
        return ShardingDecision(None, input_placements)
    lead_list = schema.args[[a.name for a in op._schema.arguments].index(lead_name)]
    outputs = [plans[position][0] if position in plans else (Replicate(),) * mesh_ndim
               for position in range(len(lead_list))]
    return ShardingDecision(outputs, input_placements)


def _elementwise_foreach_ops() -> list[OpOverload]:
    found = []
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.removeprefix("aten::")
        if not name.startswith("_foreach_") or name.rstrip("_") in _REDUCTIONS or schema.overload_name.endswith("out"):
            continue
        packet = getattr(aten, name)
        found.append(getattr(packet, schema.overload_name or "default"))
    return found


# The rule reads no Python number (only types): an optimizer's step-dependent scalars share one decision. See
# Note: Partial operands are reduced once (only self is written; every other input is read).
register_rule(*_elementwise_foreach_ops(), numbers_matter=False, adopt_reduced_partials=True)(foreach_rule)


# -- reductions over each tensor -----------------------------------------------------------------------------

@register_handler(aten._foreach_norm.Scalar)
def _foreach_norm(op: OpOverload, args: tuple, kwargs: dict) -> list[Tensor]:
    """Each tensor's whole-tensor norm, Replicate (see Note: batched foreach norms)."""
    tensors = list(args[0])
    order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
    norms: list[Any] = [None] * len(tensors)
    groups: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    for position, tensor in enumerate(tensors):
        if isinstance(tensor, DTensor) and not tensor._spec.has_partial() and order not in (0.0, -math.inf):
            sharding = tuple(i for i, p in enumerate(tensor._spec.placements) if isinstance(p, Shard))
            groups.setdefault((tensor._spec.mesh, sharding), []).append(position)
        else:
            norms[position] = torch.linalg.vector_norm(tensor, order, dtype=dtype)
    for (mesh, sharding), positions in groups.items():
        for position, norm in zip(positions, _batched_norms([tensors[p] for p in positions], mesh, sharding,
                                                           order, dtype)):
            norms[position] = norm
    return norms


def _batched_norms(tensors: list[DTensor], mesh: Any, sharding: tuple[int, ...], order: float,
                   dtype: torch.dtype | None) -> list[DTensor]:
    """Whole-tensor norms of DTensors sharded over the same mesh dims, with one all-reduce (collective)."""
    partials = []
    for tensor in tensors:
        local = tensor._local_tensor if dtype is None else tensor._local_tensor.to(dtype)
        if order == math.inf:
            magnitude = local.abs()
            partials.append(magnitude.max() if magnitude.numel() else magnitude.new_zeros(()))
        else:       # each shard's norm as torch computes a tensor's, then its p-th power: torch's sharded numerics
            partials.append(torch.linalg.vector_norm(local, order).pow(order))
    stacked = torch.stack(partials)
    reduce_op = ReduceOp.MAX if order == math.inf else ReduceOp.SUM
    for mesh_dim in sharding:
        if mesh.size(mesh_dim) > 1:
            stacked = all_reduced(stacked, reduce_op, mesh.get_group(mesh_dim))
    if order != math.inf:
        stacked = stacked.pow(1.0 / order)
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, torch.Size(()), (), stacked.dtype)
    return [DTensor._wrap_local(value, spec) for value in stacked.unbind()]


@register_handler(aten._foreach_max.default)
def _foreach_max(op: OpOverload, args: tuple, kwargs: dict) -> list[Tensor]:
    return [torch.max(t) for t in args[0]]


# -- fused optimizer kernels ----------------------------------------------------------------------------------

def _align_in_place(dt: DTensor, placements: Placements) -> None:
    """Give `dt` the placements `placements` without changing its value (collective; see Note: fused
    optimizer kernels and gradient layouts)."""
    if dt._spec.placements == placements:
        return
    dt._local_tensor = run_plan(dt._local_tensor, dt._spec, placements)
    dt._spec = dt._spec.with_placements(placements)


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value._local_tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_local(item) for item in value)
    return value


def _fused_optimizer(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    params = args[0]
    if len({p._spec.mesh if isinstance(p, DTensor) else None for p in params}) > 1:
        return _fused_by_mesh(op, args, kwargs)
    mesh = next(p for p in params if isinstance(p, DTensor))._spec.mesh
    for position, param in enumerate(params):
        if not isinstance(param, DTensor):
            continue
        if param._spec.has_partial():
            raise ShardingError(f"spmd DTensor: {op} on rank {mesh.get_rank()}: parameter {position} is "
                                f"{list(param.placements)}; a parameter can't be Partial")
        for state in args[1:]:
            if isinstance(state, (list, tuple)) and position < len(state) and isinstance(state[position], DTensor):
                _align_in_place(state[position], param._spec.placements)
    for name in ("grad_scale", "found_inf", "lr"):
        value = kwargs.get(name)
        if isinstance(value, DTensor):
            _align_in_place(value, (Replicate(),) * mesh.ndim)
    return op(*_local(args), **{k: _local(v) for k, v in kwargs.items()})


def _fused_by_mesh(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """A fused step over parameters of several meshes (expert parallelism: dense parameters on one mesh, the
    experts' on another, in one optimizer; or plain ones beside DTensors) as one call per mesh: a position's state
    lives where its parameter does, and the kernel touches each position alone."""
    length = len(args[0])
    by_mesh: dict[Any, list[int]] = {}
    for position, param in enumerate(args[0]):
        by_mesh.setdefault(param._spec.mesh if isinstance(param, DTensor) else None, []).append(position)
    per_position = {k for k, value in enumerate(args) if isinstance(value, (list, tuple)) and len(value) == length}
    merged: list[list[Any]] | None = None
    for positions in by_mesh.values():
        out = op(*(type(value)(value[i] for i in positions) if k in per_position else value
                   for k, value in enumerate(args)), **kwargs)
        if out is None:
            continue
        merged = merged if merged is not None else [[None] * length for _ in out]
        for results, returned in zip(merged, out, strict=True):
            for i, item in zip(positions, returned, strict=True):
                results[i] = item
    return None if merged is None else tuple(merged)


def _fused_optimizer_ops() -> list[OpOverload]:
    packets = [getattr(aten, name) for name in _FUSED]
    return [getattr(packet, overload) for packet in packets for overload in packet.overloads()]


register_handler(*_fused_optimizer_ops())(_fused_optimizer)


# -- GradScaler: unscale and check for infs -------------------------------------------------------------------

def _unscale_kernel(plan: LocalPlan) -> LocalKernel:
    """Unscale the local shards, then make found_inf the MAX over the mesh (see Note: GradScaler on sharded
    gradients)."""
    mesh = plan.schema.mesh
    whole = mesh.existing_group() if mesh.size() > 1 else None
    groups = [whole] if whole is not None else [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    unscale = plan.op._op

    def kernel(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
        unscale(grads, found_inf, inv_scale)
        for group in groups:
            all_reduce(found_inf, ReduceOp.MAX, group=group)
    return kernel


@register_rule(aten._amp_foreach_non_finite_check_and_unscale_.default, kernel=_unscale_kernel)
def _unscale_rule(schema: OpSchema) -> ShardingDecision:
    """Each gradient unscaled where it lies, a Partial one reduced first; DTensor found_inf / inv_scale
    Replicate (see Note: GradScaler on sharded gradients)."""
    grads = sum(isinstance(value, DTensorSpec) for value in schema.args[0])
    placements: list[Placements] = [tuple(Replicate() if p.is_partial() else p for p in spec.placements)
                                    for spec in schema.input_specs[:grads]]
    placements += [replicated(schema.mesh)] * (len(schema.input_specs) - grads)
    return ShardingDecision(None, placements)
