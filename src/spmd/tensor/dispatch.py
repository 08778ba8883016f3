"""Op dispatch for DTensor: look up the rule -> redistribute inputs -> run the local op -> wrap the outputs.

Layer: tensor. Runs below autograd (`__torch_dispatch__`), on local tensors only; collectives happen only in
redistribution (redistribute.run_plan).

Note: the dispatch fast path
The decision for a call is cached on the mesh (`DeviceMesh.dispatch_cache`, so per rank and freed with the
mesh) under a key of the op, every DTensor input's spec (hash precomputed), and every other argument (Python
numbers keyed with their type, so 1 and 1.0 differ; `int[]` arguments as `(list, *ints)`; plain scalar tensors by
shape/dtype/device). A hit costs one pass over the arguments, one dict lookup, the local op and one wrapper
allocation per output. A miss runs the rule, propagates the global output metadata with meta tensors, checks
everything and caches it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.utils._mode_utils import no_dispatch

from spmd.tensor.placement import Replicate, normalize_placements
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import HANDLERS, OpSchema, ShardingDecision, ShardingError, lookup_rule, warn_fallback_once
from spmd.tensor.spec import DTensorSpec, Placements, contiguous_stride

_CACHE_LIMIT = 8192


class MixedTensorError(ValueError):
    """A DTensor and a plain (non-scalar) tensor met in one op, where the plain tensor's layout is ambiguous.

    A ValueError, not a TypeError: torch turns a TypeError raised inside `a + b` into NotImplemented, which
    would hide this message behind "unsupported operand type(s)".
    """


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    """What the op's schema says about mutation: which arguments it writes and what its outputs alias."""

    mutated_args: frozenset[int]                 # positional indices written in place
    mutated_kwargs: frozenset[str]
    returns_mutated: tuple[int | str, ...] | None  # per output, the written argument it returns; None: fresh
    out_args: tuple[str, ...] = ()               # an out= variant's output arguments (keyword-only, returned)


_OP_INFO: dict[OpOverload, _OpInfo] = {}


def _op_info(op: OpOverload) -> _OpInfo:
    info = _OP_INFO.get(op)
    if info is None:
        schema = op._schema
        written: dict[str, int | str] = {}
        mutated_args, mutated_kwargs = set(), set()
        positional = 0
        for argument in schema.arguments:
            alias = argument.alias_info
            is_written = alias is not None and alias.is_write
            where: int | str = argument.name if argument.kwarg_only else positional
            if not argument.kwarg_only:
                positional += 1
            if is_written:
                (mutated_kwargs if argument.kwarg_only else mutated_args).add(where)
                for name in alias.before_set:
                    written[name] = where
        returns = []
        for ret in schema.returns:
            alias = ret.alias_info
            if alias is not None and alias.is_write:
                returns.append(next(written[name] for name in alias.before_set))
            else:
                returns.append(None)
        returns_mutated = tuple(returns) if returns and all(r is not None for r in returns) else None
        out_args = tuple(r for r in returns_mutated or () if isinstance(r, str))
        is_out = bool(out_args) and len(out_args) == len(returns) and set(out_args) == mutated_kwargs
        info = _OpInfo(frozenset(mutated_args), frozenset(mutated_kwargs), returns_mutated,
                       out_args if is_out and not mutated_args else ())
        _OP_INFO[op] = info
    return info


_FUNCTIONAL: dict[OpOverload, OpOverload | None] = {}


def _functional_of(op: OpOverload, out_args: tuple[str, ...]) -> OpOverload | None:
    """The functional overload of an out= op (maximum.out -> maximum.default): same name, the same arguments
    without the outputs, nothing written. None if there is none."""
    if op not in _FUNCTIONAL:
        wanted = [(a.name, str(a.type)) for a in op._schema.arguments if a.name not in out_args]
        packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
        found = None
        for name in packet.overloads() if packet is not None else ():
            candidate = getattr(packet, name)
            arguments = candidate._schema.arguments
            if ([(a.name, str(a.type)) for a in arguments] == wanted
                    and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments)):
                found = candidate
                break
        _FUNCTIONAL[op] = found
    return _FUNCTIONAL[op]


# -- argument walking ---------------------------------------------------------------------------------------

def _key_of(value: Any, dtensor_type: type, dtensors: list, plain: list) -> Any:
    """The cache-key form of one argument; collects DTensors and plain tensors in order."""
    if isinstance(value, dtensor_type):
        dtensors.append(value)
        return value._spec
    if isinstance(value, (list, tuple)):
        return tuple(_key_of(item, dtensor_type, dtensors, plain) for item in value)
    if isinstance(value, Tensor):
        plain.append(value)
        return (Tensor, value.shape, value.dtype, value.device)
    if isinstance(value, (bool, int, float, complex)):
        return (type(value), value)
    return value


def _substitute(value: Any, dtensor_type: type, spec_type: type, locals_: Iterator[Tensor],
                plain: Iterator[Tensor]) -> Any:
    """`value` with each DTensor (or DTensorSpec) replaced by the next local tensor, and each plain tensor by the
    next plain tensor of this call."""
    if isinstance(value, (dtensor_type, spec_type)):
        return next(locals_)
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(item, dtensor_type, spec_type, locals_, plain) for item in value)
    if isinstance(value, Tensor):
        return next(plain)
    return value


def schema_form(value: Any, dtensor_type: type) -> Any:
    """`value` with every DTensor (also inside lists/tuples) replaced by its spec: what rules see."""
    if isinstance(value, dtensor_type):
        return value._spec
    if isinstance(value, (list, tuple)):
        return type(value)(schema_form(item, dtensor_type) for item in value)
    return value


def meta_form(value: Any) -> Any:
    """`value` with specs and tensors replaced by meta tensors, to infer output shapes without computing."""
    if isinstance(value, DTensorSpec):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(meta_form(item) for item in value)
    if isinstance(value, Tensor):
        return value.to("meta")
    return value


def _mutated_positions(op: OpOverload, args: tuple, kwargs: dict, dtensor_type: type) -> set[int]:
    """Indices (in input_specs order) of the DTensor inputs the op writes in place."""
    info = _op_info(op)
    positions: set[int] = set()
    counter = [0]

    def walk(value: Any, written: bool) -> None:
        if isinstance(value, dtensor_type):
            if written:
                positions.add(counter[0])
            counter[0] += 1
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, written)

    for index, value in enumerate(args):
        walk(value, index in info.mutated_args)
    for name, value in kwargs.items():
        walk(value, name in info.mutated_kwargs)
    return positions


# -- compiled decisions -------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Compiled:
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
    fast: int = dataclasses.field(init=False)      # _FAST_WRAP / _FAST_INPLACE: runnable by the fast path
    fn: Any = dataclasses.field(init=False)        # the op's C++ callable (skips OpOverload.__call__)

    def __post_init__(self) -> None:
        self.fn = self.op._op
        flat_local_args = self.local_args is None or not any(
            isinstance(item, (Tensor, list, tuple)) and not _is_int_list(item) for item in self.local_args)
        simple = (not self.fallback and not self.inplace_view and self.single_output and flat_local_args
                  and self.local_kwargs is None and all(target is None for target in self.input_targets))
        if simple and self.returns_mutated is None and self.output_specs[0] is not None:
            self.fast = _FAST_WRAP
        elif simple and self.returns_mutated == (0,):
            self.fast = _FAST_INPLACE
        else:
            self.fast = 0


_FAST_WRAP, _FAST_INPLACE = 1, 2
_NUMBERS = (bool, int, float)


def _is_int_list(value: Any) -> bool:
    return type(value) in (list, tuple) and all(type(item) is int for item in value)


_INT_LIST_ARGS: dict[OpOverload, frozenset[int]] = {}


def _int_list_args(op: OpOverload) -> frozenset[int]:
    """Positions of the op's `int[]` arguments (sizes, dims). The dispatcher hands them to __torch_dispatch__ as
    lists of Python ints, so their cache key can be `(list, *value)` with no per-item type check (a Scalar[]
    argument, whose 1 and 1.0 differ, is keyed item by item)."""
    found = _INT_LIST_ARGS.get(op)
    if found is None:
        positional = [a for a in op._schema.arguments if not a.kwarg_only]
        found = frozenset(k for k, a in enumerate(positional) if str(a.type) in ("List[int]", "Optional[List[int]]"))
        _INT_LIST_ARGS[op] = found
    return found


def _where(op: OpOverload, specs: tuple[DTensorSpec, ...]) -> str:
    rank = specs[0].mesh.get_rank() if specs else "?"
    shown = ", ".join(f"{list(s.placements)} {tuple(s.shape)}" for s in specs)
    return f"spmd DTensor: {op} on rank {rank} with inputs [{shown}]"


def _compile(op: OpOverload, args: tuple, kwargs: dict, dtensors: list, dtensor_type: type) -> _Compiled:
    specs = tuple(dt._spec for dt in dtensors)
    mesh = specs[0].mesh
    for spec in specs[1:]:
        if spec.mesh != mesh:
            raise ValueError(f"{_where(op, specs)}: DTensors on different meshes ({mesh} and {spec.mesh}) can't "
                             f"meet in one op; redistribute one onto the other's mesh first")
    info = _op_info(op)
    mutated = _mutated_positions(op, args, kwargs, dtensor_type)
    rule = lookup_rule(op)
    if rule is None:
        single = info.returns_mutated is not None and len(info.returns_mutated) == 1
        return _Compiled(op, (), (), single, info.returns_mutated, None, None, fallback=True)
    schema = OpSchema(op, schema_form(args, dtensor_type), schema_form(kwargs, dtensor_type), specs)
    try:
        decision = rule(schema)
    except ShardingError as error:
        raise ShardingError(f"{_where(op, specs)}: {error}") from None
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
        normalized = normalize_placements(out_placements, out.ndim, mesh.ndim, f"{_where(op, specs)}: output")
        output_specs.append(DTensorSpec(mesh, normalized, out.shape, out.stride(), out.dtype))
    return _Compiled(op, targets, tuple(output_specs), single, info.returns_mutated, decision.local_args,
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
        raise ShardingError(f"{_where(op, specs)}: the rule gave {len(wanted)} input placements for "
                            f"{len(specs)} DTensor inputs")
    targets: list[Placements | None] = []
    reduce_in_place: set[int] = set()
    for k, (spec, placements) in enumerate(zip(specs, wanted)):
        if placements is not None:
            placements = normalize_placements(placements, spec.ndim, spec.mesh.ndim, f"{_where(op, specs)}: input {k}")
        if placements is None or placements == spec.placements:
            targets.append(None)
            continue
        if k in mutated and _only_reduces(spec, placements):
            reduce_in_place.add(k)
        elif k in mutated:
            raise ShardingError(f"{_where(op, specs)}: the op writes input {k} in place, which would first have to "
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
        raise ShardingError(f"{_where(op, schema.input_specs)}: could not compute the output shapes on meta "
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
        raise ShardingError(f"{_where(op, specs)}: the rule gave {len(placements)} output placements for "
                            f"{count} outputs")
    return [None if p is None else tuple(p) for p in placements]


# Autograd builds the gradients of unused outputs (of split, unbind, ...) as plain zeros and concatenates them
# with DTensor gradients, and cumprod's backward selects between a DTensor and plain zeros with `where`; for these
# ops a plain tensor is taken as a Replicate DTensor (same value everywhere).
_PLAIN_AS_REPLICATE = frozenset({torch.ops.aten.cat.default, torch.ops.aten.stack.default,
                                 torch.ops.aten.where.self})


def _replicate_plain(cls: type, args: tuple, mesh: Any) -> tuple:
    def convert(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(convert(item) for item in value)
        if isinstance(value, Tensor) and not isinstance(value, cls):
            spec = DTensorSpec(mesh, _replicated(mesh.ndim), value.shape, contiguous_stride(value.shape), value.dtype)
            return cls._wrap_local(value.contiguous(), spec)
        return value
    return tuple(convert(value) for value in args)


# -- running ------------------------------------------------------------------------------------------------

def dispatch(cls: type, op: OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    """DTensor.__torch_dispatch__ (see Note: the dispatch fast path)."""
    handler = HANDLERS.get(op)
    if handler is not None:
        return handler(op, args, kwargs or {})
    result = _fast_path(cls, op, args, kwargs)
    if result is not _MISS:
        return result
    kwargs = kwargs or {}
    out_args = _op_info(op).out_args
    if out_args:
        functional = _functional_of(op, out_args)
        if functional is not None:
            return _run_out_variant(cls, op, functional, args, kwargs, out_args)
    dtensors: list = []
    plain: list[Tensor] = []
    key_parts: list[Any] = [op]
    int_lists = _int_list_args(op)
    for index, value in enumerate(args):
        if index in int_lists and type(value) in (list, tuple):
            key_parts.append((list, *value))      # the fast path's key for it (see _int_list_args)
        else:
            key_parts.append(_key_of(value, cls, dtensors, plain))
    for name, value in kwargs.items():
        key_parts.append(name)
        key_parts.append(_key_of(value, cls, dtensors, plain))
    if not dtensors:
        return op(*args, **kwargs)
    if plain and op in _PLAIN_AS_REPLICATE:
        args = _replicate_plain(cls, args, dtensors[0]._spec.mesh)
        return dispatch(cls, op, types, args, kwargs)
    for tensor in plain:
        if tensor.numel() != 1:
            raise MixedTensorError(
                f"{_where(op, tuple(dt._spec for dt in dtensors))}: got a plain torch.Tensor of shape "
                f"{tuple(tensor.shape)} beside DTensors; its layout is ambiguous. Make it a DTensor first "
                f"(distribute_tensor(t, mesh, placements) or DTensor.from_local(...)). Only one-element plain "
                f"tensors are treated as replicated scalars.")
    mesh = dtensors[0]._spec.mesh
    key = tuple(key_parts)
    cache = mesh.dispatch_cache
    try:
        compiled = cache.get(key)
    except TypeError:          # an unhashable argument: decide without caching
        key, compiled = None, None
    if compiled is None:
        compiled = _compile(op, args, kwargs, dtensors, cls)
        if key is not None:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            cache[key] = compiled
    if compiled.fallback:
        return _run_fallback(cls, op, args, kwargs, dtensors, plain, compiled)
    return _run(cls, args, kwargs, dtensors, plain, compiled)


_MISS = object()
_make_wrapper_subclass = Tensor._make_wrapper_subclass


def _fast_path(cls: type, op: OpOverload, args: tuple, kwargs: dict | None) -> Any:
    """A cached call with flat positional args, tensor-free kwargs, no redistribution and one output (most
    calls): the key built and the op run inline. Returns _MISS to take the general path. Keys match the general
    path's."""
    key: list[Any] = [op]
    first = None
    int_lists = None
    for index, value in enumerate(args):
        kind = type(value)
        if kind is cls:
            key.append(value._spec)
            if first is None:
                first = value
        elif kind in _NUMBERS:
            key.append((kind, value))
        elif kind is list or kind is tuple:
            if int_lists is None:
                int_lists = _INT_LIST_ARGS.get(op)
                if int_lists is None:
                    int_lists = _int_list_args(op)
            if index not in int_lists:
                return _MISS
            key.append((list, *value))
        elif isinstance(value, Tensor):
            return _MISS
        else:
            key.append(value)
    if first is None:
        return _MISS
    if kwargs:
        for name, value in kwargs.items():
            kind = type(value)
            if kind is cls or kind is list or kind is tuple or isinstance(value, Tensor):
                return _MISS
            key.append(name)
            key.append((kind, value) if kind in _NUMBERS else value)
    try:
        compiled = first._spec.mesh.dispatch_cache.get(tuple(key))
    except TypeError:
        return _MISS
    if compiled is None or not compiled.fast:
        return _MISS
    kwargs = kwargs or {}
    if compiled.local_args is None:
        out = compiled.fn(*[value._local_tensor if type(value) is cls else value for value in args], **kwargs)
    else:         # e.g. view: the local sizes replace the global ones; specs stand for the DTensors in order
        locals_ = iter([value._local_tensor for value in args if type(value) is cls])
        out = compiled.fn(*[next(locals_) if type(value) is DTensorSpec else value for value in compiled.local_args],
                          **kwargs)
    if compiled.fast == _FAST_INPLACE:
        return args[0]
    spec = compiled.output_specs[0]
    wrapped = _make_wrapper_subclass(cls, spec.shape, strides=spec.stride, dtype=spec.dtype, device=out.device)
    wrapped._local_tensor = out
    wrapped._spec = spec
    return wrapped


# Note: in-place ops on Partial tensors
# An in-place op that is not linear in its Partial self (x.pow_(2), x.add_(1)) can't keep self Partial. Its rule
# asks for self Replicate; since that keeps the global value and the local shape, dispatch all-reduces self and
# writes the sum into self's local tensor, updates self's spec, then runs the op. Views taken of self earlier
# keep their own (Partial) spec and local values: they read the partial sums as before, which is what they hold.
#
# In-place view ops (squeeze_, unsqueeze_, transpose_, t_, as_strided_) change self's shape: the local op runs on
# the local tensor, then self's spec becomes the output spec and the op runs once more on the wrapper itself with
# dispatch disabled, which changes only the wrapper's sizes and strides (no data is behind a wrapper).


# Note: out= variants
# `torch.maximum(a, b, out=c)` runs as the functional op (`maximum.default`, with its own rule and cache entry)
# followed by a write of each result into its out tensor, which takes the result's placements (the rule's
# choice): when its local shape already fits, the result is copied into its local tensor (cast to its dtype);
# otherwise the local tensor is resized first, and so is the wrapper when the global shape changes (torch's
# resize semantics for out=; the wrapper's resize allocates a storage of the global size, as a plain tensor would).


def _run_out_variant(cls: type, op: OpOverload, functional: OpOverload, args: tuple, kwargs: dict,
                     out_args: tuple[str, ...]) -> Any:
    outs = [kwargs[name] for name in out_args]
    rest = {name: value for name, value in kwargs.items() if name not in out_args}
    result = functional(*args, **rest)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    for out, value in zip(outs, results):
        if not isinstance(out, cls) or not isinstance(value, cls):
            specs = tuple(v._spec for v in (*outs, *results) if isinstance(v, cls))
            raise MixedTensorError(f"{_where(op, specs)}: an out= argument and the result must both be DTensors, "
                                   f"got {type(out).__name__} for a {type(value).__name__} result")
        _write_out(out, value)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _write_out(out: Any, value: Any) -> None:
    """Write DTensor `value` into DTensor `out` (see Note: out= variants)."""
    spec, source = value._spec, value._local_tensor
    if tuple(out.shape) != tuple(spec.shape):
        with no_dispatch():
            out.resize_(spec.shape)
    local = out._local_tensor
    if local.shape != source.shape:
        local.resize_(source.shape)
    local.copy_(source)
    out._spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, tuple(out.stride()), out.dtype)


def _run(cls: type, args: tuple, kwargs: dict, dtensors: list, plain: list[Tensor], compiled: _Compiled) -> Any:
    locals_ = []
    for k, (dt, target) in enumerate(zip(dtensors, compiled.input_targets) if compiled.input_targets else ()):
        local = dt._local_tensor
        if target is not None and k in compiled.reduce_in_place:
            local.copy_(run_plan(local, dt._spec, target))
            spec = dt._spec
            dt._spec = DTensorSpec(spec.mesh, target, spec.shape, spec.stride, spec.dtype)
            target = None
        locals_.append(local if target is None else run_plan(local, dt._spec, target))
    if not compiled.input_targets:
        locals_ = [dt._local_tensor for dt in dtensors]
    spec_type = DTensorSpec
    local_args = compiled.local_args if compiled.local_args is not None else args
    local_kwargs = compiled.local_kwargs if compiled.local_kwargs is not None else kwargs
    local_iter, plain_iter = iter(locals_), iter(plain)
    call_args = [_substitute(a, cls, spec_type, local_iter, plain_iter) for a in local_args]
    call_kwargs = {k: _substitute(v, cls, spec_type, local_iter, plain_iter) for k, v in local_kwargs.items()}
    out = compiled.fn(*call_args, **call_kwargs)
    if compiled.inplace_view:
        self_ = args[0]
        self_._spec = compiled.output_specs[0]
        with no_dispatch():
            compiled.fn(*args, **kwargs)
    return _wrap(cls, out, args, kwargs, compiled)


def _wrap(cls: type, out: Any, args: tuple, kwargs: dict, compiled: _Compiled) -> Any:
    if compiled.returns_mutated is not None:
        returned = [args[w] if isinstance(w, int) else kwargs[w] for w in compiled.returns_mutated]
        if not returned:
            return None if out is None else out
        return returned[0] if compiled.single_output and len(returned) == 1 else tuple(returned)
    if compiled.single_output:
        spec = compiled.output_specs[0]
        return out if spec is None else cls._wrap_local(out, spec)
    wrapped = [item if spec is None else cls._wrap_local(item, spec)
               for item, spec in zip(out, compiled.output_specs)]
    return type(out)(wrapped) if isinstance(out, tuple) else wrapped


def _run_fallback(cls: type, op: OpOverload, args: tuple, kwargs: dict, dtensors: list, plain: list[Tensor],
                  compiled: _Compiled) -> Any:
    """Replicate-compute-reshard (see the rules module docstring); writes mutated inputs back."""
    warn_fallback_once(op)
    mesh = dtensors[0]._spec.mesh
    full_locals = [run_plan(dt._local_tensor, dt._spec, _replicated(mesh.ndim)) for dt in dtensors]
    local_iter, plain_iter = iter(full_locals), iter(plain)
    call_args = [_substitute(a, cls, DTensorSpec, local_iter, plain_iter) for a in args]
    call_kwargs = {k: _substitute(v, cls, DTensorSpec, local_iter, plain_iter) for k, v in kwargs.items()}
    out = op(*call_args, **call_kwargs)
    for position in _mutated_positions(op, args, kwargs, cls):
        dt, full = dtensors[position], full_locals[position]
        if full is not dt._local_tensor:
            dt._local_tensor.copy_(dt._spec.local_from_full(full))
    if compiled.returns_mutated is not None:
        return _wrap(cls, out, args, kwargs, compiled)
    first = dtensors[0]._spec

    def reshard(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        stride = contiguous_stride(value.shape)
        if value.shape == first.shape and not first.has_partial():
            spec = DTensorSpec(mesh, first.placements, value.shape, stride, value.dtype)
            return cls._wrap_local(spec.local_from_full(value), spec)
        spec = DTensorSpec(mesh, _replicated(mesh.ndim), value.shape, stride, value.dtype)
        return cls._wrap_local(value.contiguous(), spec)

    if isinstance(out, (tuple, list)):
        return type(out)(reshard(item) for item in out)
    return reshard(out)


def local_as(dtensor: Any, placements: Placements) -> Tensor:
    """`dtensor`'s local tensor laid out as `placements` (for handlers; collective over the mesh when it moves)."""
    return run_plan(dtensor._local_tensor, dtensor._spec, tuple(placements))


def _replicated(ndim: int) -> Placements:
    return (Replicate(),) * ndim
