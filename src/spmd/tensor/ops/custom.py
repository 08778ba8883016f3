"""Ops whose local computation is not the op itself: a sharding decision plus a custom local kernel.

Layer: tensor. Used by handlers (rules.register_handler) in this package: `mean` over a sharded dim (a local
sum scaled by the GLOBAL count, exact for uneven shards), max/min with empty shards, var/std and norms over
sharded dims (one small all-reduce inside the kernel), the vocab-sharded `embedding` (ids outside this rank's
rows masked), `nll_loss` with mean reduction, and attention with an empty query shard. The flow is dispatch's
(decide -> redistribute -> run -> wrap), and so is the cost: the decision AND the specialized kernel are
cached per mesh under a key of the op and its arguments, so a repeated call is one pass over the arguments,
one dict lookup, the kernel and the wrap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import MixedTensorError, meta_form, schema_form
from spmd.tensor.placement import normalize_placements
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import OpSchema, ShardingDecision, ShardingError
from spmd.tensor.spec import DTensorSpec, Placements

LocalKernel = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """What a kernel factory sees once per distinct call: the call with GLOBAL specs (`schema`), the specs of
    the local tensors the kernel will receive (after redistribution, in schema order), and the output specs."""

    schema: OpSchema
    input_specs: tuple[DTensorSpec, ...]
    output_specs: tuple[DTensorSpec | None, ...]

    @property
    def op(self) -> OpOverload:
        return self.schema.op


KernelFactory = Callable[[LocalPlan], LocalKernel]


@dataclasses.dataclass(frozen=True)
class _Plan:
    targets: tuple[Placements | None, ...] | None    # None: no input moves
    output_specs: tuple[DTensorSpec | None, ...]
    single_output: bool
    kernel: LocalKernel


_NUMBERS = (bool, int, float)


def _key_of(value: Any, dtensors: list[DTensor], plain: list[Tensor], numbers: bool) -> Any:
    """The cache-key form of one argument; collects DTensors and plain tensors in order. Python numbers are
    keyed by value, or by type alone when `numbers` is False."""
    if isinstance(value, DTensor):
        dtensors.append(value)
        return value._spec
    if isinstance(value, (list, tuple)):
        if all(type(item) is DTensor for item in value):       # a foreach list: one pass
            dtensors.extend(value)
            return (_LIST, *[item._spec for item in value])
        return tuple([_key_of(item, dtensors, plain, numbers) for item in value])
    if isinstance(value, Tensor):
        plain.append(value)
        return (Tensor, value.shape, value.dtype, value.device)
    if isinstance(value, _NUMBERS):
        return (type(value), value) if numbers else type(value)
    return value


_LIST = object()
_FLAT = object()


def _local_form(value: Any, locals_: list[Tensor], index: list[int]) -> Any:
    """`value` with its DTensors replaced by the next entries of `locals_` (`index[0]` is the next one)."""
    if isinstance(value, DTensor):
        index[0] += 1
        return locals_[index[0] - 1]
    if isinstance(value, (list, tuple)):
        if value and all(type(item) is DTensor for item in value):      # a foreach list: one slice
            start = index[0]
            index[0] += len(value)
            return type(value)(locals_[start:index[0]])
        return type(value)([_local_form(item, locals_, index) for item in value])
    return value


def _where(op: OpOverload, specs: tuple[DTensorSpec, ...]) -> str:
    shown = ", ".join(f"{list(s.placements)} {tuple(s.shape)}" for s in specs)
    return f"spmd DTensor: {op} on rank {specs[0].mesh.get_rank()} with inputs [{shown}]"


def _plan(op: OpOverload, args: tuple, kwargs: dict, dtensors: list[DTensor],
          rule: Callable[[OpSchema], ShardingDecision], make_kernel: KernelFactory) -> _Plan:
    specs = tuple(dt._spec for dt in dtensors)
    mesh = specs[0].mesh
    for spec in specs[1:]:
        if spec.mesh != mesh:
            raise ValueError(f"{_where(op, specs)}: DTensors on different meshes ({mesh} and {spec.mesh}) can't "
                             f"meet in one op; redistribute one onto the other's mesh first")
    schema = OpSchema(op, schema_form(args, DTensor), {k: schema_form(v, DTensor) for k, v in kwargs.items()}, specs)
    try:
        decision = rule(schema)
        meta = op(*meta_form(schema.args), **{k: meta_form(v) for k, v in schema.kwargs.items()})
    except ShardingError as error:
        raise ShardingError(f"{_where(op, specs)}: {error}") from None
    wanted = decision.input_placements or [None] * len(specs)
    targets: list[Placements | None] = []
    local_specs = []
    for k, (spec, placements) in enumerate(zip(specs, wanted)):
        if placements is not None:
            placements = normalize_placements(placements, spec.ndim, mesh.ndim, f"spmd DTensor: {op} input {k}")
        moved = placements is not None and placements != spec.placements
        targets.append(placements if moved else None)
        local_specs.append(spec.with_placements(placements) if moved else spec)
    single = not isinstance(meta, (tuple, list))
    outputs = [meta] if single else list(meta)
    placements_out = decision.output_placements
    per_output = [placements_out] if single else list(placements_out or [None] * len(outputs))
    output_specs: list[DTensorSpec | None] = []
    for out, out_placements in zip(outputs, per_output):
        if not isinstance(out, Tensor) or out_placements is None:
            output_specs.append(None)
            continue
        normalized = normalize_placements(tuple(out_placements), out.ndim, mesh.ndim, f"spmd DTensor: {op} output")
        output_specs.append(DTensorSpec(mesh, normalized, out.shape, out.stride(), out.dtype))
    kernel = make_kernel(LocalPlan(schema, tuple(local_specs), tuple(output_specs)))
    moves = tuple(targets) if any(t is not None for t in targets) else None
    return _Plan(moves, tuple(output_specs), single, kernel)


def run_custom(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
               rule: Callable[[OpSchema], ShardingDecision], make_kernel: KernelFactory, *,
               numbers_matter: bool = True, adopt_reduced_partials: bool = False) -> Any:
    """Run `op` on DTensors: `rule` decides the placements, `make_kernel(LocalPlan)` builds the local function
    for that decision (both once per distinct call, cached per mesh), inputs are redistributed, the kernel
    computes this rank's outputs from the call's arguments with DTensors replaced by local tensors, and they
    are wrapped as DTensors.

    Collective when the decision redistributes inputs or the kernel communicates. The kernel returns local
    tensors laid out as the output specs say (a tensor, or a tuple with one entry per output).
    `numbers_matter=False` says that neither the rule nor the kernel factory reads Python-number arguments
    (only their types), so calls differing in them share one cached plan: an optimizer's step-dependent
    scalars (bias corrections, step sizes) would otherwise make every step a cache miss.
    `adopt_reduced_partials=True` (for inputs the op only reads): a Partial input that the decision reduces
    keeps the reduced layout afterwards, in place (same global value), so later ops don't reduce it again.
    """
    fast = _flat_call(op, args, kwargs, rule, make_kernel, numbers_matter, adopt_reduced_partials)
    if fast is not _NOT_FLAT:
        return fast
    dtensors: list[DTensor] = []
    plain: list[Tensor] = []
    key = (op, *[_key_of(value, dtensors, plain, numbers_matter) for value in args],
           *[(name, _key_of(value, dtensors, plain, numbers_matter)) for name, value in kwargs.items()])
    for tensor in plain:
        if tensor.numel() != 1:
            raise MixedTensorError(
                f"{_where(op, tuple(dt._spec for dt in dtensors))}: got a plain torch.Tensor of shape "
                f"{tuple(tensor.shape)} beside DTensors; its layout is ambiguous. Make it a DTensor first "
                f"(distribute_tensor or DTensor.from_local). Only one-element plain tensors are taken as scalars.")
    cache = dtensors[0]._spec.mesh.dispatch_cache
    try:
        plan = cache.get(key)
    except TypeError:          # an unhashable argument: decide without caching
        key, plan = None, None
    if plan is None:
        plan = _plan(op, args, kwargs, dtensors, rule, make_kernel)
        if key is not None:
            _store(cache, key, plan)
    if plan.targets is None:
        locals_ = [dt._local_tensor for dt in dtensors]
    else:
        locals_ = _move_inputs(dtensors, plan.targets, adopt_reduced_partials)
    index = [0]
    local_args = [_local_form(value, locals_, index) for value in args]
    local_kwargs = {name: _local_form(value, locals_, index) for name, value in kwargs.items()}
    return _wrap_outputs(plan, plan.kernel(*local_args, **local_kwargs))


def _move_inputs(dtensors: list[DTensor], targets: tuple[Placements | None, ...], adopt: bool) -> list[Tensor]:
    """The local tensors the kernel gets: each input redistributed to its target (collective). An input passed
    twice is moved once. With `adopt`, a Partial input takes its reduced layout in place."""
    moved: dict[tuple[int, Placements], Tensor] = {}
    locals_ = []
    for dt, target in zip(dtensors, targets):
        if target is None:
            locals_.append(dt._local_tensor)
            continue
        local = moved.get((id(dt), target))
        if local is None:
            local = run_plan(dt._local_tensor, dt._spec, target)
            moved[(id(dt), target)] = local
        locals_.append(local)
    if adopt:
        for dt, target in zip(dtensors, targets):
            if target is not None and dt._spec.has_partial() and dt._spec.placements != target:
                dt._local_tensor = moved[(id(dt), target)]
                dt._spec = dt._spec.with_placements(target)
    return locals_


def _flat_key(op: OpOverload, args: tuple, kwargs: dict, dtensors: list[DTensor], numbers: bool) -> tuple | None:
    """The cache key of a call whose positional arguments are DTensors, lists of DTensors (foreach), numbers,
    lists of numbers, dtypes or None, and whose keyword arguments hold no tensor (most calls); else None.
    Numbers are keyed by value, or by type (lists by length) when `numbers` is False. The key's form differs
    from `_key_of`'s, so the two never share an entry."""
    key: list[Any] = [op, _FLAT]
    for value in args:
        kind = type(value)
        if kind is DTensor:
            dtensors.append(value)
            key.append(value._spec)
        elif kind in _NUMBERS:
            key.append((kind, value) if numbers else kind)
        elif kind is list or kind is tuple:
            if value and type(value[0]) is DTensor:
                specs: list[Any] = [_LIST]
                for item in value:
                    if type(item) is not DTensor:
                        return None
                    specs.append(item._spec)
                dtensors.extend(value)
                key.append(tuple(specs))
            else:
                for item in value:
                    if type(item) not in _NUMBERS:
                        return None
                key.append((kind, *value) if numbers else (kind, len(value)))
        elif value is None or kind is torch.dtype:
            key.append(value)
        else:
            return None
    for name, value in kwargs.items():
        kind = type(value)
        if kind in _NUMBERS:
            key.append((name, (kind, value) if numbers else kind))
        elif value is None or kind is torch.dtype or kind is str:
            key.append((name, value))
        else:
            return None
    return tuple(key) if dtensors else None


def _flat_call(op: OpOverload, args: tuple, kwargs: dict, rule: Callable[[OpSchema], ShardingDecision],
               make_kernel: KernelFactory, numbers: bool, adopt: bool) -> Any:
    """run_custom for a flat call (see `_flat_key`): one pass over the arguments. Returns _NOT_FLAT for any
    other call."""
    dtensors: list[DTensor] = []
    key = _flat_key(op, args, kwargs, dtensors, numbers)
    if key is None:
        return _NOT_FLAT
    cache = dtensors[0]._spec.mesh.dispatch_cache
    plan = cache.get(key)
    if plan is None:
        plan = _plan(op, args, kwargs, dtensors, rule, make_kernel)
        _store(cache, key, plan)
    if plan.targets is None:
        local_args = [value._local_tensor if type(value) is DTensor else
                      [item._local_tensor for item in value] if type(value) in (list, tuple) and value
                      and type(value[0]) is DTensor else value for value in args]
    else:
        locals_ = _move_inputs(dtensors, plan.targets, adopt)
        index = [0]
        local_args = [_local_form(value, locals_, index) for value in args]
    return _wrap_outputs(plan, plan.kernel(*local_args, **kwargs))


def _wrap_outputs(plan: _Plan, out: Any) -> Any:
    if plan.single_output:
        spec = plan.output_specs[0]
        return out if spec is None else _wrap(out, spec)
    wrapped = [item if spec is None else _wrap(item, spec) for item, spec in zip(out, plan.output_specs)]
    return wrapped if isinstance(out, list) else tuple(wrapped)


_make_wrapper_subclass = Tensor._make_wrapper_subclass


def _wrap(local: Tensor, spec: DTensorSpec) -> DTensor:
    """DTensor._wrap_local, inlined (this is per output per call)."""
    wrapped = _make_wrapper_subclass(DTensor, spec.shape, strides=spec.stride, dtype=spec.dtype,
                                     device=local.device)
    wrapped._local_tensor = local
    wrapped._spec = spec
    return wrapped


_NOT_FLAT = object()
_CACHE_LIMIT = 8192        # as dispatch's: the mesh's decision cache is cleared when it grows past this


def _store(cache: dict, key: tuple, plan: _Plan) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = plan


def empty_outputs(plan: LocalPlan, like: Tensor, zeros: bool = False) -> Any:
    """This rank's outputs for an empty local piece: empty (or zero) tensors of the output specs' local shapes."""
    make = like.new_zeros if zeros else like.new_empty
    outs = [make(spec.local_shape(), dtype=spec.dtype) for spec in plan.output_specs if spec is not None]
    return outs[0] if len(outs) == 1 else tuple(outs)
