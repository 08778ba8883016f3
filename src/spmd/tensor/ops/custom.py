"""Ops whose local computation is not the op itself: a sharding decision plus a custom local kernel.

Layer: tensor. Used by handlers (rules.register_handler) in this package: `mean` over a sharded dim (a local
sum scaled by the GLOBAL count, exact for uneven shards), the vocab-sharded `embedding` (mask ids outside this
rank's rows), and `nll_loss` with mean reduction. The flow is dispatch's (decide -> redistribute -> run ->
wrap) with the decision cached the same way, per mesh, so these ops cost what a rule costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import MixedTensorError
from spmd.tensor.placement import normalize_placements
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import OpSchema, ShardingDecision, ShardingError
from spmd.tensor.spec import DTensorSpec, Placements

LocalKernel = Callable[["LocalCall"], Any]


@dataclasses.dataclass(frozen=True)
class LocalCall:
    """What a local kernel receives: the op, the call's arguments with every DTensor replaced by its
    (redistributed) local tensor, the specs those local tensors have (`input_specs`, in schema order), and the
    output specs."""

    op: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    input_specs: tuple[DTensorSpec, ...]
    output_specs: tuple[DTensorSpec | None, ...]


@dataclasses.dataclass(frozen=True)
class _Plan:
    targets: tuple[Placements | None, ...]
    input_specs: tuple[DTensorSpec, ...]
    output_specs: tuple[DTensorSpec | None, ...]
    single_output: bool


def _schema_form(value: Any, dtensors: list[DTensor]) -> Any:
    if isinstance(value, DTensor):
        dtensors.append(value)
        return value._spec
    if isinstance(value, (list, tuple)):
        return type(value)(_schema_form(item, dtensors) for item in value)
    return value


def _key_form(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_key_form(item) for item in value)
    if isinstance(value, Tensor):
        return (Tensor, value.shape, value.dtype, value.device)
    if isinstance(value, (bool, int, float)):
        return (type(value), value)
    return value


def _meta_form(value: Any) -> Any:
    if isinstance(value, DTensorSpec):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta_form(item) for item in value)
    if isinstance(value, Tensor):
        return value.to("meta")
    return value


def _local_form(value: Any, locals_: Iterator[Tensor]) -> Any:
    if isinstance(value, DTensorSpec):
        return next(locals_)
    if isinstance(value, (list, tuple)):
        return type(value)(_local_form(item, locals_) for item in value)
    return value


def _check_plain_scalars(op: OpOverload, args: Any, kwargs: dict[str, Any], dtensors: list[DTensor]) -> None:
    """Plain tensors beside DTensors must be one-element scalars, as in dispatch."""
    def walk(value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, Tensor) and value.numel() != 1:
            shown = ", ".join(f"{list(dt.placements)} {tuple(dt.shape)}" for dt in dtensors)
            raise MixedTensorError(
                f"spmd DTensor: {op} on rank {dtensors[0]._spec.mesh.get_rank()} with inputs [{shown}]: got a "
                f"plain torch.Tensor of shape {tuple(value.shape)} beside DTensors; its layout is ambiguous. "
                f"Make it a DTensor first (distribute_tensor or DTensor.from_local).")
    walk(args)
    walk(list(kwargs.values()))


def _plan(op: OpOverload, schema: OpSchema, decision: ShardingDecision) -> _Plan:
    mesh = schema.mesh
    where = f"spmd DTensor: {op} on rank {mesh.get_rank()}"
    wanted = decision.input_placements or [None] * len(schema.input_specs)
    targets, specs = [], []
    for k, (spec, placements) in enumerate(zip(schema.input_specs, wanted)):
        if placements is not None:
            placements = normalize_placements(placements, spec.ndim, mesh.ndim, f"{where}: input {k}")
        if placements is None or placements == spec.placements:
            targets.append(None)
            specs.append(spec)
        else:
            targets.append(placements)
            specs.append(spec.with_placements(placements))
    meta = op(*_meta_form(schema.args), **{k: _meta_form(v) for k, v in schema.kwargs.items()})
    single = not isinstance(meta, (tuple, list))
    outputs = [meta] if single else list(meta)
    placements_out = decision.output_placements
    per_output = [placements_out] if single else list(placements_out or [None] * len(outputs))
    output_specs: list[DTensorSpec | None] = []
    for out, out_placements in zip(outputs, per_output):
        if not isinstance(out, Tensor) or out_placements is None:
            output_specs.append(None)
            continue
        normalized = normalize_placements(tuple(out_placements), out.ndim, mesh.ndim, f"{where}: output")
        output_specs.append(DTensorSpec(mesh, normalized, out.shape, out.stride(), out.dtype))
    return _Plan(tuple(targets), tuple(specs), tuple(output_specs), single)


def run_custom(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
               rule: Callable[[OpSchema], ShardingDecision], kernel: LocalKernel) -> Any:
    """Run `op` on DTensors: `rule` decides the placements (cached per mesh like dispatch's decisions), inputs
    are redistributed, `kernel(LocalCall)` computes this rank's outputs, and they are wrapped as DTensors.

    Collective when the decision redistributes inputs. The kernel must return local tensors laid out as the
    output specs say (a tensor, or a tuple with one entry per output).
    """
    dtensors: list[DTensor] = []
    schema_args = _schema_form(args, dtensors)
    schema_kwargs = {k: _schema_form(v, dtensors) for k, v in kwargs.items()}
    mesh = dtensors[0]._spec.mesh
    _check_plain_scalars(op, schema_args, schema_kwargs, dtensors)
    key = ("spmd.tensor.ops.custom", op, *(_key_form(a) for a in schema_args),
           *((k, _key_form(v)) for k, v in schema_kwargs.items()))
    cache = mesh.dispatch_cache
    plan = cache.get(key)
    if plan is None:
        specs = tuple(dt._spec for dt in dtensors)
        for spec in specs[1:]:
            if spec.mesh != mesh:
                raise ValueError(f"spmd DTensor: {op} on rank {mesh.get_rank()}: DTensors on different meshes "
                                 f"({mesh} and {spec.mesh}) can't meet in one op")
        schema = OpSchema(op, schema_args, schema_kwargs, specs)
        try:
            plan = _plan(op, schema, rule(schema))
        except ShardingError as error:
            shown = ", ".join(f"{list(s.placements)} {tuple(s.shape)}" for s in specs)
            raise ShardingError(f"spmd DTensor: {op} on rank {mesh.get_rank()} with inputs [{shown}]: "
                                f"{error}") from None
        cache[key] = plan
    locals_ = [dt._local_tensor if target is None else run_plan(dt._local_tensor, dt._spec, target)
               for dt, target in zip(dtensors, plan.targets)]
    it = iter(locals_)
    call = LocalCall(op, _local_form(schema_args, it), {k: _local_form(v, it) for k, v in schema_kwargs.items()},
                     plan.input_specs, plan.output_specs)
    out = kernel(call)
    return wrap_outputs(out, plan.output_specs, plan.single_output)


def wrap_outputs(out: Any, output_specs: Sequence[DTensorSpec | None], single_output: bool) -> Any:
    """Wrap local outputs as DTensors with `output_specs` (None: returned as they are)."""
    if single_output:
        spec = output_specs[0]
        return out if spec is None else DTensor._wrap_local(out, spec)
    wrapped = [item if spec is None else DTensor._wrap_local(item, spec) for item, spec in zip(out, output_specs)]
    return tuple(wrapped)
