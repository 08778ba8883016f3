"""Sharding rules for normalizations: softmax / log_softmax and layer norm, forward and backward.

Layer: tensor. Decisions only. (rms_norm needs no rule here: in this torch build `aten.rms_norm` and
`aten._fused_rms_norm` are CompositeImplicitAutograd and reach DTensor as pow / mean / rsqrt / mul, which the
pointwise and reduction rules shard.)

Note: normalizing over a dim
A softmax over dim d, or a layer norm over its trailing normalized dims, reads the whole of those dims for
every output element, so they must not be sharded: a Shard there is gathered first. Every other dim is
independent rows and stays sharded, so the candidates on a mesh dim are "Replicate" and "Shard(d) for each
row dim d". The backward ops are linear in the incoming gradient (the saved output / mean / rstd fixed), so a
Partial gradient passes through as Partial. Layer norm's weight and bias gradients are sums over the rows: with
the rows sharded they come out Partial(sum), reduced when the optimizer combines them with the parameter.
"""

from __future__ import annotations

from torch import ops

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import OpSchema, Strategy, register_strategy
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


def _row_dims(ndim: int, normalized: set[int]) -> list[int]:
    return [d for d in range(ndim) if d not in normalized]


# -- softmax ------------------------------------------------------------------------------------------------

@register_strategy(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def _softmax(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]
    dim = schema.args[1] % max(spec.ndim, 1)
    return [Strategy((Replicate(),), Replicate()),
            *(Strategy((Shard(d),), Shard(d)) for d in _row_dims(spec.ndim, {dim}))]


@register_strategy(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(schema: OpSchema) -> list[Strategy]:
    grad = schema.input_specs[0]
    dim = schema.args[2] % max(grad.ndim, 1)
    candidates = [Strategy((Replicate(), Replicate()), Replicate()),
                  *(Strategy((Shard(d), Shard(d)), Shard(d)) for d in _row_dims(grad.ndim, {dim}))]
    for placement in _linear_partials(grad):
        candidates.append(Strategy((placement, Replicate()), placement))
    return candidates


def _linear_partials(spec: DTensorSpec) -> list[Partial]:
    """The linear Partial placements `spec` has (a gradient that may pass through a linear op as it is)."""
    found: list[Partial] = []
    for placement in spec.placements:
        if isinstance(placement, Partial) and placement.is_linear and placement not in found:
            found.append(placement)
    return found


# -- layer norm -----------------------------------------------------------------------------------------------

def _per_input(schema: OpSchema, placements: dict[int, Placement], default: Placement) -> tuple[Placement, ...]:
    """One placement per DTensor input: `placements[i]` for positional argument i, else `default`."""
    out: list[Placement] = []
    for index, arg in enumerate(schema.args):
        if isinstance(arg, DTensorSpec):
            out.append(placements.get(index, default))
    return tuple(out)


@register_strategy(aten.native_layer_norm.default)
def _layer_norm(schema: OpSchema) -> list[Strategy]:
    spec = schema.input_specs[0]
    axis = spec.ndim - len(schema.args[1])
    candidates = [Strategy(_per_input(schema, {}, Replicate()), (Replicate(),) * 3)]
    for d in range(axis):        # input, mean and rstd share the row dims; weight and bias stay Replicate
        candidates.append(Strategy(_per_input(schema, {0: Shard(d)}, Replicate()), (Shard(d),) * 3))
    return candidates


@register_strategy(aten.native_layer_norm_backward.default)
def _layer_norm_backward(schema: OpSchema) -> list[Strategy]:
    # args: grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
    grad = schema.input_specs[0]
    axis = grad.ndim - len(schema.args[2])
    candidates = [Strategy(_per_input(schema, {}, Replicate()), (Replicate(),) * 3)]
    for d in range(axis):
        rows = {0: Shard(d), 1: Shard(d), 3: Shard(d), 4: Shard(d)}
        candidates.append(Strategy(_per_input(schema, rows, Replicate()), (Shard(d), Partial(), Partial())))
    for placement in _linear_partials(grad):
        candidates.append(Strategy(_per_input(schema, {0: placement}, Replicate()), (placement,) * 3))
    return candidates
