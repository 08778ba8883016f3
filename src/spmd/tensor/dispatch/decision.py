"""Compiling a call: run the op's rule, check its ShardingDecision, infer the outputs' global metadata, build
the op's local kernel, and keep it all as a `Compiled` entry of the mesh's dispatch cache.

Layer: tensor. Decisions on metadata; no communication (a kernel factory only builds a function).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from spmd.tensor.dispatch.keys import meta_form, schema_form
from spmd.tensor.dispatch.signature import mutated_positions, op_info
from spmd.tensor.placement import Placement, Shard, _StridedShard, normalize_placements
from spmd.tensor.rules import LocalPlan, OpSchema, ShardingDecision, ShardingError, lookup_rule, op_options
from spmd.tensor.spec import DTensorSpec, Placements


class Path(enum.Enum):
    """How a cached call runs (see Note: the dispatch fast path)."""

    GENERAL = "general"            # redistribute inputs, substitute nested arguments, in-place views
    DIRECT = "direct"              # local tensors straight from the arguments; the outputs through run.wrap
    DIRECT_ONE = "direct, one"     # ... DTensors only at the top level, one fresh output: inline in run.dispatch
    DIRECT_SELF = "direct, self"   # ... top-level DTensors, the call's own arguments, returns its first (in place)
    FALLBACK = "fallback"          # no rule: replicate-compute-reshard


@dataclasses.dataclass(frozen=True)
class Checked:
    """A rule's decision after the checks: per input its target placements (None: keep), the written inputs
    reduced in place first, and per output its spec (None: not a tensor)."""

    targets: tuple[Placements | None, ...]
    reduce_in_place: frozenset[int]
    output_specs: tuple[DTensorSpec | None, ...]
    single_output: bool


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A cached decision: where inputs go, what outputs are, and the local function to call."""

    op: OpOverload
    fn: Any                                        # the op's C++ callable (skips OpOverload.__call__), or its kernel
    path: Path
    input_targets: tuple[Placements | None, ...]   # per DTensor input: redistribute to these, or keep
    output_specs: tuple[DTensorSpec | None, ...]   # per output (None: not a tensor)
    single_output: bool
    returns_mutated: tuple[int | str, ...] | None
    local_args: tuple | None = None
    local_kwargs: dict | None = None
    reduce_in_place: frozenset[int] = frozenset()  # mutated DTensor inputs whose Partial is all-reduced first
    adopt: frozenset[int] = frozenset()            # read inputs that keep the layout they are reduced to
    mutated: frozenset[int] = frozenset()          # DTensor inputs the op writes
    list_args: frozenset[int] = frozenset()        # DIRECT paths: positional args that are lists of DTensors
    inplace_view: bool = False                     # the op changes self's shape/stride (squeeze_, t_, ...)
    returns_view: bool = False                     # a view op: its outputs alias its input (run.py, Note: writes
                                                   # through views of gathered copies)


def where(op: OpOverload, specs: tuple[DTensorSpec, ...]) -> str:
    rank = specs[0].mesh.get_rank() if specs else "?"
    shown = ", ".join(f"{list(s.placements)} {tuple(s.shape)}" for s in specs)
    return f"spmd DTensor: {op} on rank {rank} with inputs [{shown}]"


def compile_call(op: OpOverload, args: tuple, kwargs: dict, dtensors: list, plain: list[Tensor],
                 dtensor_type: type) -> Compiled:
    """Decide a call (the op's rule, checked), build its local function and choose how it runs."""
    specs = tuple(dt._spec for dt in dtensors)
    mesh = specs[0].mesh
    for spec in specs[1:]:
        if spec.mesh != mesh:
            raise ValueError(f"{where(op, specs)}: DTensors on different meshes ({mesh} and {spec.mesh}) can't "
                             f"meet in one op; redistribute one onto the other's mesh first")
    info = op_info(op)
    mutated = frozenset(mutated_positions(op, args, kwargs, dtensor_type))
    rule = lookup_rule(op) if mesh.ndim else _on_one_rank
    if rule is None:
        single = info.returns_mutated is not None and len(info.returns_mutated) == 1
        return Compiled(op, op._op, Path.FALLBACK, (), (), single, info.returns_mutated, mutated=mutated,
                        returns_view=info.returns_view)
    schema = OpSchema(op, schema_form(args, dtensor_type), schema_form(kwargs, dtensor_type), specs)
    try:
        decision = rule(schema)
    except ShardingError as error:
        raise ShardingError(f"{where(op, specs)}: {error}") from None
    checked = check_decision(schema, decision, mutated)
    check_strided_alignment(schema, checked)
    options = op_options(op)
    adopt = frozenset(k for k, target in enumerate(checked.targets) if target is not None and k not in mutated
                      and specs[k].has_partial()) if options.adopt_reduced_partials else frozenset()
    fn = op._op if options.kernel is None or not mesh.ndim else _kernel(schema, checked, options.kernel)
    list_args = frozenset(k for k, value in enumerate(args) if _is_dtensor_list(value, dtensor_type))
    path = _path(op, args, kwargs, plain, dtensor_type, decision, checked, info.returns_mutated, list_args)
    return Compiled(op, fn, path, checked.targets, checked.output_specs, checked.single_output,
                    info.returns_mutated, decision.local_args, decision.local_kwargs, checked.reduce_in_place,
                    adopt, mutated, list_args, torch.Tag.inplace_view in op.tags, info.returns_view)


def _on_one_rank(schema: OpSchema) -> ShardingDecision:
    """Every op's decision on a 0-d mesh (one rank, no mesh dims, torch's mesh for an unparallelised run): the
    local tensors are the whole tensors, so the op runs on them as they are and each output has no placements."""
    return ShardingDecision(output_placements=())


def _kernel(schema: OpSchema, checked: Checked, make_kernel: Any) -> Any:
    """The op's local kernel for this decision, from its factory (see OpOptions.kernel)."""
    op = schema.op
    local_specs = tuple(spec if target is None else spec.with_placements(target)
                        for spec, target in zip(schema.input_specs, checked.targets))
    try:
        kernel = make_kernel(LocalPlan(schema, local_specs, checked.output_specs))
    except ShardingError as error:
        raise ShardingError(f"{where(op, schema.input_specs)}: {error}") from None
    return op._op if kernel is op else kernel


def check_decision(schema: OpSchema, decision: ShardingDecision, mutated: frozenset[int]) -> Checked:
    """The one place a rule's decision is checked (every op, with or without a kernel): one input placements
    entry per DTensor input and one output entry per output, each valid for its tensor and the mesh; written
    inputs kept; local_args / local_kwargs with a place for every DTensor and plain tensor. Runs the op on meta
    tensors for the outputs' global metadata. Raises ShardingError (or the placement errors) naming the op."""
    op, specs = schema.op, schema.input_specs
    if not isinstance(decision, ShardingDecision):
        raise ShardingError(f"{where(op, specs)}: the rule returned a {type(decision).__name__}, not a "
                            f"ShardingDecision")
    targets, reduce_in_place = _input_targets(op, decision, specs, mutated)
    _check_local_args(schema, decision)
    meta_out = _propagate_meta(schema)
    single = not isinstance(meta_out, (tuple, list))
    outputs = [meta_out] if single else list(meta_out)
    placements = _output_placements(op, decision, specs, len(outputs))
    mesh = schema.mesh
    output_specs = []
    for k, (out, out_placements) in enumerate(zip(outputs, placements)):
        if not isinstance(out, Tensor) or out_placements is None:
            output_specs.append(None)
            continue
        what = f"{where(op, specs)}: output" + ("" if single else f" {k}")
        normalized = normalize_placements(out_placements, out.ndim, mesh.ndim, what)
        output_specs.append(DTensorSpec(mesh, normalized, out.shape, out.stride(), out.dtype))
    return Checked(targets, reduce_in_place, tuple(output_specs), single)


# Note: ops on strided shards
# A rule written for Shard sees a _StridedShard as the Shard it is a subclass of. That is right where the rule
# passes the placement through to operands and outputs of the same shape (pointwise ops, foreach ops, *_like:
# every operand's block is the same block of the same tensor, so the local op is elementwise-aligned), and
# wrong where it maps it onto another dim or shape as a plain Shard (a view, a transpose, a matmul), which would
# mislabel the local blocks. So, where a decision keeps a _StridedShard (an input that stays strided), dispatch
# checks that, per foreach position (or for the whole call), every sharded input has the very placements and
# shape of the strided one, and every sharded output too; any other output is Replicate or Partial (a whole-dim
# reduction, whose result doesn't depend on which block a rank holds). Otherwise it raises. Rules that build
# plain Shards ask for the strided input to be redistributed to them instead, which the planner does exactly.

def check_strided_alignment(schema: OpSchema, checked: Checked) -> None:
    """Raise ShardingError when the decision keeps a _StridedShard in a call whose operands or outputs are not
    laid out alike (see Note: ops on strided shards)."""
    specs = schema.input_specs
    effective = [spec.placements if target is None else target for spec, target in zip(specs, checked.targets)]
    if not any(isinstance(p, _StridedShard) for placements in effective for p in placements):
        return
    positions = _list_positions(schema)
    groups: dict[int | None, set[tuple[Placements, torch.Size]]] = {}
    for placements, spec, position in zip(effective, specs, positions):
        if any(isinstance(p, Shard) for p in placements):
            groups.setdefault(position, set()).add((placements, spec.shape))
    strided = {key for key, members in groups.items()
               if any(isinstance(p, _StridedShard) for placements, _ in members for p in placements)}
    problem = None
    for key in strided:
        if len(groups[key]) > 1:
            problem = "its sharded operands are laid out differently: " + ", ".join(
                f"{list(placements)} {tuple(shape)}" for placements, shape in sorted(groups[key], key=repr))
    per_position = any(position is not None for position in positions)
    for k, out in enumerate(checked.output_specs):
        if problem is not None or out is None or not any(isinstance(p, Shard) for p in out.placements):
            continue
        key = k if per_position else None
        is_strided = any(isinstance(p, _StridedShard) for p in out.placements)
        if (is_strided or key in strided) and groups.get(key) != {(out.placements, out.shape)}:
            problem = f"output {k} would be {list(out.placements)} {tuple(out.shape)}"
    if problem is not None:
        raise ShardingError(f"{where(schema.op, specs)}: this op can't keep a _StridedShard operand: {problem}. "
                            f"_StridedShard works in ops whose sharded operands and outputs are all laid out "
                            f"alike (pointwise, foreach, *_like, norms); redistribute the operand first (to "
                            f"Shard or Replicate placements) or take its full_tensor()")


def _list_positions(schema: OpSchema) -> list[int | None]:
    """Per DTensor input (input_specs order), its position in the list argument holding it, or None."""
    found: list[int | None] = []

    def walk(value: Any, position: int | None) -> None:
        if isinstance(value, DTensorSpec):
            found.append(position)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, index if position is None else position)
    for value in (*schema.args, *schema.kwargs.values()):
        walk(value, None)
    return found


def _path(op: OpOverload, args: tuple, kwargs: dict, plain: list[Tensor], dtensor_type: type,
          decision: ShardingDecision, checked: Checked, returns_mutated: tuple[int | str, ...] | None,
          list_args: frozenset[int]) -> Path:
    """How calls with this key run. The key fixes the structure of the arguments (which are DTensors, lists of
    DTensors, plain tensors), so this holds for every call that finds the entry."""
    local_args = decision.local_args
    top_level = (all(type(value) is dtensor_type or k in list_args or not _holds_tensor(value)
                     for k, value in enumerate(args))
                 and not any(_holds_tensor(value) for value in kwargs.values()))
    flat_local_args = local_args is None or (not list_args and not any(
        isinstance(item, (Tensor, list, tuple)) and not _is_int_list(item) for item in local_args))
    moves = any(target is not None for target in checked.targets)
    if (plain or moves or not top_level or not flat_local_args or decision.local_kwargs is not None
            or torch.Tag.inplace_view in op.tags):
        return Path.GENERAL
    if checked.single_output and returns_mutated is None and checked.output_specs[0] is not None and not list_args:
        return Path.DIRECT_ONE
    if checked.single_output and returns_mutated == (0,) and not list_args and local_args is None:
        return Path.DIRECT_SELF
    return Path.DIRECT


def _is_int_list(value: Any) -> bool:
    return type(value) in (list, tuple) and all(type(item) is int for item in value)


def _is_dtensor_list(value: Any, dtensor_type: type) -> bool:
    return type(value) in (list, tuple) and len(value) > 0 and all(type(item) is dtensor_type for item in value)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(_holds_tensor(item) for item in value)


def _places(value: Any) -> tuple[int, int]:
    """(DTensor places, plain tensors) in an argument written like schema.args."""
    if isinstance(value, DTensorSpec):
        return 1, 0
    if isinstance(value, Tensor):
        return 0, 1
    if isinstance(value, (list, tuple)):
        counts = [_places(item) for item in value]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)
    return 0, 0


def _check_local_args(schema: OpSchema, decision: ShardingDecision) -> None:
    """local_args / local_kwargs must hold a DTensorSpec for each DTensor input and each plain tensor of the
    call: the local tensors are substituted into them in order."""
    if decision.local_args is None and decision.local_kwargs is None:
        return
    args = schema.args if decision.local_args is None else decision.local_args
    kwargs = schema.kwargs if decision.local_kwargs is None else decision.local_kwargs
    given = _places([*args, *kwargs.values()])
    wanted = _places([*schema.args, *schema.kwargs.values()])
    if given != wanted:
        raise ShardingError(f"{where(schema.op, schema.input_specs)}: the rule's local_args/local_kwargs hold "
                            f"{given[0]} DTensor places and {given[1]} plain tensors for {wanted[0]} DTensor "
                            f"inputs and {wanted[1]} plain tensors")


def _only_reduces(spec: DTensorSpec, placements: Placements) -> bool:
    """Whether going from `spec` to `placements` only turns Partial mesh dims into Replicate: the global value
    and the local shape stay, so it can be done in place on a tensor the op writes."""
    return all(old == new or (old.is_partial() and new.is_replicate())
               for old, new in zip(spec.placements, placements))


def _input_targets(op: OpOverload, decision: ShardingDecision, specs: tuple[DTensorSpec, ...],
                   mutated: frozenset[int]) -> tuple[tuple[Placements | None, ...], frozenset[int]]:
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


def _propagate_meta(schema: OpSchema) -> Any:
    """Run the op on meta tensors with the GLOBAL shapes: the outputs' global shape, stride and dtype."""
    op = schema.op
    try:
        kwargs = {k: "meta" if k == "device" and v is not None else meta_form(v) for k, v in schema.kwargs.items()}
        return op(*meta_form(schema.args), **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
        raise ShardingError(f"{where(op, schema.input_specs)}: could not compute the output shapes on meta "
                            f"tensors ({type(error).__name__}: {error})") from error


def _output_placements(op: OpOverload, decision: ShardingDecision, specs: tuple[DTensorSpec, ...],
                       count: int) -> list[Placements | None]:
    """Per output, its placements: the decision gives one Placements tuple (for every output), or one entry
    per output."""
    placements = decision.output_placements
    if placements is None:
        return [None] * count
    if not specs[0].mesh.ndim:
        return [()] * count
    if len(placements) and all(isinstance(p, Placement) for p in placements):
        return [tuple(placements)] * count   # one Placements tuple, for the output or for every output
    if len(placements) != count:
        raise ShardingError(f"{where(op, specs)}: the rule gave {len(placements)} output placements for "
                            f"{count} output{'s' if count != 1 else ''}")
    return [None if p is None else tuple(p) for p in placements]
