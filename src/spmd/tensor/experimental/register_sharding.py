"""`register_sharding`: a user's sharding strategies for an op (a custom op DTensor has no rule for, or an aten op
whose rule they want to replace), in torch's form (torch's `register_sharding`).

Layer: tensor. The user's function gets the op's arguments with each DTensor replaced by its DTensorSpec (it
has `.ndim`, `.shape`, `.placements`) and returns the acceptable shardings on ONE mesh dim, each a pair
`(output placements, input placements)`: one output entry per value the op returns, and one input entry per
positional argument (None for a non-tensor; keyword tensors follow). On every mesh dim the cheapest pair for the
inputs' current placements is chosen, as for spmd's own strategies (rules.register_strategy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch._ops import OpOverload

from spmd.tensor.dispatch import forget_decisions
from spmd.tensor.placement import Placement
from spmd.tensor.rules import OpSchema, ShardingDecision, ShardingError, Strategy, override_rule, pick_per_mesh_dim

__all__ = ["register_sharding"]

PlacementList = Sequence[Placement | None]
ShardingFn = Callable[..., Sequence[tuple[PlacementList, PlacementList]]]


def register_sharding(op: OpOverload | list[OpOverload]) -> Callable[[ShardingFn], ShardingFn]:
    """Decorator: the function lists `op`'s acceptable (output placements, input placements) pairs on one mesh
    dim; it becomes the op's sharding rule, replacing spmd's own if it has one. Returns the function itself."""
    overloads = op if isinstance(op, list) else [op]
    for overload in overloads:
        if not isinstance(overload, OpOverload):
            raise TypeError(f"register_sharding takes an OpOverload (e.g. torch.ops.aten._softmax.default or a "
                            f"custom op's .default) or a list of them, got {overload!r}")

    def decorate(sharding_fn: ShardingFn) -> ShardingFn:
        for overload in overloads:
            override_rule(overload, functools.partial(_decide, sharding_fn))
        forget_decisions()
        return sharding_fn
    return decorate


def _decide(sharding_fn: ShardingFn, schema: OpSchema) -> ShardingDecision:
    """The rule made from the user's function: its pairs become per-mesh-dim Strategies."""
    outputs = len(schema.op._schema.returns)
    strategies = [_strategy(schema, outputs, k, pair)
                  for k, pair in enumerate(sharding_fn(*schema.args, **schema.kwargs))]
    return pick_per_mesh_dim(schema, strategies)


def _strategy(schema: OpSchema, outputs: int, index: int, pair: Any) -> Strategy:
    where = f"the sharding registered for {schema.op}: shardings[{index}]"
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ShardingError(f"{where} is {pair!r}; each must be a pair (output placements, input placements)")
    out, ins = (list(part) if isinstance(part, (tuple, list)) else [part] for part in pair)
    if len(out) != outputs:
        raise ShardingError(f"{where} gives {len(out)} output placements; {schema.op} returns {outputs} "
                            f"value(s): give one per value (None for a non-tensor)")
    inputs = tuple(p for p in ins if p is not None)
    if len(inputs) != len(schema.input_specs):
        raise ShardingError(f"{where} gives {len(inputs)} input placements (not None) for "
                            f"{len(schema.input_specs)} DTensor inputs; give one per tensor argument and None for "
                            f"the others")
    return Strategy(inputs, out[0] if outputs == 1 else tuple(out))
