"""Compiling a call: run the op's rule, check its ShardingDecision, infer the outputs' global metadata, and keep
it all as a `Compiled` entry of the mesh's dispatch cache.

Layer: tensor. Pure decisions on metadata; no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from spmd.tensor.dispatch.keys import meta_form, schema_form
from spmd.tensor.dispatch.signature import mutated_positions, op_info
from spmd.tensor.placement import normalize_placements
from spmd.tensor.rules import OpSchema, ShardingDecision, ShardingError, lookup_rule
from spmd.tensor.spec import DTensorSpec, Placements


@dataclasses.dataclass
class Compiled:
    """A cached decision: where inputs go, what outputs are, and how to call the local op."""

    op: OpOverload
    input_targets: tuple[Placements | None, ...]   # per DTensor input: redistribute to these, or keep
    output_specs: tuple[DTensorSpec | None, ...]   # per output (None: not a tensor)
    single_output: bool
    returns_mutated: tuple[int | str, ...] | None
    local_args: tuple | None
    local_kwargs: dict | None
    fallback: bool = False
    reduce_in_place: frozenset[int] = frozenset()   # mutated DTensor inputs whose Partial is all-reduced first
    inplace_view: bool = False                     # the op changes self's shape/stride (squeeze_, t_, ...)
    fast: int = dataclasses.field(init=False)      # FAST_WRAP / FAST_INPLACE: runnable by the fast path
    fn: Any = dataclasses.field(init=False)        # the op's C++ callable (skips OpOverload.__call__)

    def __post_init__(self) -> None:
        self.fn = self.op._op
        flat_local_args = self.local_args is None or not any(
            isinstance(item, (Tensor, list, tuple)) and not _is_int_list(item) for item in self.local_args)
        simple = (not self.fallback and not self.inplace_view and self.single_output and flat_local_args
                  and self.local_kwargs is None and all(target is None for target in self.input_targets))
        if simple and self.returns_mutated is None and self.output_specs[0] is not None:
            self.fast = FAST_WRAP
        elif simple and self.returns_mutated == (0,):
            self.fast = FAST_INPLACE
        else:
            self.fast = 0


FAST_WRAP, FAST_INPLACE = 1, 2


def _is_int_list(value: Any) -> bool:
    return type(value) in (list, tuple) and all(type(item) is int for item in value)


def where(op: OpOverload, specs: tuple[DTensorSpec, ...]) -> str:
    rank = specs[0].mesh.get_rank() if specs else "?"
    shown = ", ".join(f"{list(s.placements)} {tuple(s.shape)}" for s in specs)
    return f"spmd DTensor: {op} on rank {rank} with inputs [{shown}]"


def compile_call(op: OpOverload, args: tuple, kwargs: dict, dtensors: list, dtensor_type: type) -> Compiled:
    specs = tuple(dt._spec for dt in dtensors)
    mesh = specs[0].mesh
    for spec in specs[1:]:
        if spec.mesh != mesh:
            raise ValueError(f"{where(op, specs)}: DTensors on different meshes ({mesh} and {spec.mesh}) can't "
                             f"meet in one op; redistribute one onto the other's mesh first")
    info = op_info(op)
    mutated = mutated_positions(op, args, kwargs, dtensor_type)
    rule = lookup_rule(op)
    if rule is None:
        single = info.returns_mutated is not None and len(info.returns_mutated) == 1
        return Compiled(op, (), (), single, info.returns_mutated, None, None, fallback=True)
    schema = OpSchema(op, schema_form(args, dtensor_type), schema_form(kwargs, dtensor_type), specs)
    try:
        decision = rule(schema)
    except ShardingError as error:
        raise ShardingError(f"{where(op, specs)}: {error}") from None
    targets, reduce_in_place = _input_targets(op, decision, specs, mutated)
    meta_out = _propagate_meta(op, decision, schema)
    single = not isinstance(meta_out, (tuple, list))
    outputs = [meta_out] if single else list(meta_out)
    placements = _output_placements(op, decision, specs, len(outputs), single)
    output_specs = []
    for out, out_placements in zip(outputs, placements):
        if not isinstance(out, Tensor) or out_placements is None:
            output_specs.append(None)
            continue
        normalized = normalize_placements(out_placements, out.ndim, mesh.ndim, f"{where(op, specs)}: output")
        output_specs.append(DTensorSpec(mesh, normalized, out.shape, out.stride(), out.dtype))
    return Compiled(op, targets, tuple(output_specs), single, info.returns_mutated, decision.local_args,
                     decision.local_kwargs, reduce_in_place=reduce_in_place,
                     inplace_view=torch.Tag.inplace_view in op.tags)


def _only_reduces(spec: DTensorSpec, placements: Placements) -> bool:
    """Whether going from `spec` to `placements` only turns Partial mesh dims into Replicate: the global value
    and the local shape stay, so it can be done in place on a tensor the op writes."""
    return all(old == new or (old.is_partial() and new.is_replicate())
               for old, new in zip(spec.placements, placements))


def _input_targets(op: OpOverload, decision: ShardingDecision, specs: tuple[DTensorSpec, ...],
                   mutated: set[int]) -> tuple[tuple[Placements | None, ...], frozenset[int]]:
    """Per DTensor input, the placements to redistribute it to (None: keep); and the mutated inputs among them
    (only Partial -> Replicate is allowed there: see Note: in-place ops on Partial tensors)."""
    wanted = decision.input_placements
    if wanted is None:
        return (None,) * len(specs), frozenset()
    if len(wanted) != len(specs):
        raise ShardingError(f"{where(op, specs)}: the rule gave {len(wanted)} input placements for "
                            f"{len(specs)} DTensor inputs")
    targets: list[Placements | None] = []
    reduce_in_place: set[int] = set()
    for k, (spec, placements) in enumerate(zip(specs, wanted)):
        if placements is not None:
            placements = normalize_placements(placements, spec.ndim, spec.mesh.ndim, f"{where(op, specs)}: input {k}")
        if placements is None or placements == spec.placements:
            targets.append(None)
            continue
        if k in mutated and _only_reduces(spec, placements):
            reduce_in_place.add(k)
        elif k in mutated:
            raise ShardingError(f"{where(op, specs)}: the op writes input {k} in place, which would first have to "
                                f"change from {list(spec.placements)} to {list(placements)}; redistribute it "
                                f"yourself first (x = x.redistribute(mesh, {list(placements)}))")
        targets.append(placements)
    return tuple(targets), frozenset(reduce_in_place)


def _propagate_meta(op: OpOverload, decision: ShardingDecision, schema: OpSchema) -> Any:
    """Run the op on meta tensors with the GLOBAL shapes: the outputs' global shape, stride and dtype."""
    try:
        kwargs = {k: "meta" if k == "device" and v is not None else meta_form(v) for k, v in schema.kwargs.items()}
        return op(*meta_form(schema.args), **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        raise ShardingError(f"{where(op, schema.input_specs)}: could not compute the output shapes on meta "
                            f"tensors ({type(error).__name__}: {error})") from error


def _output_placements(op: OpOverload, decision: ShardingDecision, specs: tuple[DTensorSpec, ...], count: int,
                       single: bool) -> list[Placements | None]:
    placements = decision.output_placements
    if placements is None:
        return [None] * count
    if single:
        return [tuple(placements)]     # type: ignore[arg-type]
    if len(placements) and not isinstance(placements[0], (tuple, list, type(None))):
        return [tuple(placements)] * count   # one Placements tuple given for every output
    if len(placements) != count:
        raise ShardingError(f"{where(op, specs)}: the rule gave {len(placements)} output placements for "
                            f"{count} outputs")
    return [None if p is None else tuple(p) for p in placements]
