"""Running a call: the handler or the cached decision (compiled on a miss), the fast path, input
redistribution, the local op, and wrapping the outputs; out= variants and the fallback.

Layer: tensor. Collective only through redistribution (redistribute.run_plan) and the fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.utils._mode_utils import no_dispatch

from spmd.tensor.dispatch.decision import Compiled, Path, compile_call, where
from spmd.tensor.dispatch.keys import call_key, substitute
from spmd.tensor.dispatch.signature import functional_of, mutated_positions, op_info
from spmd.tensor.placement import Replicate
from spmd.tensor.random import get_generator
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import HANDLERS, ShardingError, note_fallback
from spmd.tensor.spec import DTensorSpec, Placements, contiguous_stride

_CACHE_LIMIT = 8192


class MixedTensorError(ValueError):
    """A DTensor and a plain (non-scalar) tensor met in one op, where the plain tensor's layout is ambiguous.

    A ValueError, not a TypeError: torch turns a TypeError raised inside `a + b` into NotImplemented, which
    would hide this message behind "unsupported operand type(s)".
    """


# Autograd builds the gradients of unused outputs (of split, unbind, ...) as plain zeros and concatenates them
# with DTensor gradients, and cumprod's backward selects between a DTensor and plain zeros with `where`; for these
# ops a plain tensor is taken as a Replicate DTensor (same value everywhere).
_PLAIN_AS_REPLICATE = frozenset({torch.ops.aten.cat.default, torch.ops.aten.stack.default,
                                 torch.ops.aten.where.self})


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a plain tensor meeting DTensors there is one
    a derivative formula made from saved metadata (the zeros index_put's backward puts, the index trace's fills, the
    zeros cummax's scatters into), the same on every rank, and is taken as a Replicate DTensor as in
    _PLAIN_AS_REPLICATE's ops."""
    return torch._C._current_graph_task_id() != -1


_implicitly_replicated: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_implicit_replication",
                                                                            default=False)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside the block, a plain torch.Tensor meeting DTensors in an op is taken as a Replicate DTensor on their
    mesh (torch's `implicit_replication`): for values the caller knows are equal on every rank.

    Per rank: it applies to the ops this rank's thread runs in the block (thread ranks don't see each other's
    blocks). A plain tensor that differs between ranks gives each rank a different "replica": wrong results,
    as in torch, so use it only for values equal everywhere.
    """
    token = _implicitly_replicated.set(True)
    try:
        yield
    finally:
        _implicitly_replicated.reset(token)


def values_of(local: Tensor) -> Tensor:
    """`local` with torch's lazy conjugate and negative bits (`x.conj()` of a complex tensor, `_neg_view`) made
    values: a DTensor's wrapper doesn't carry them, and inside dispatch torch skips the fallback that resolves them
    for an op, which would then read the stored values (a product with x.conj() computed with x). Unchanged (no
    copy) where neither bit is set."""
    if local.is_conj() or local.is_neg():
        return local.resolve_conj().resolve_neg()
    return local


def _replicate_plain(cls: type, args: tuple, mesh: Any) -> tuple:
    def convert(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(convert(item) for item in value)
        if isinstance(value, Tensor) and not isinstance(value, cls):
            spec = DTensorSpec(mesh, _replicated(mesh.ndim), value.shape, contiguous_stride(value.shape), value.dtype)
            return cls._wrap_local(values_of(value).contiguous(), spec)
        return value
    return tuple(convert(value) for value in args)


def dispatch(cls: type, op: OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None, *,
             by_rule: bool = False) -> Any:
    """DTensor.__torch_dispatch__ (see Note: the dispatch fast path). `by_rule=True` skips `op`'s handler: what a
    handler installed over a rule (rules.overriding_handlers) calls for the calls it leaves to the rule."""
    if not by_rule:
        handler = HANDLERS.get(op)
        if handler is not None:
            return handler(op, args, kwargs or {})
    if kwargs is None:
        kwargs = {}
    key, dtensors, plain = call_key(op, args, kwargs, cls)
    if not dtensors:
        return op(*args, **kwargs)
    cache = dtensors[0]._spec.mesh.dispatch_cache
    try:
        compiled = cache.get(key)
    except TypeError:          # an unhashable argument: decide without caching
        key, compiled = None, None
    if compiled is None:
        return _first_call(cls, op, types, args, kwargs, key, dtensors, plain)
    path = compiled.path
    if path is _DIRECT_ONE:          # most calls
        local_args = compiled.local_args
        if local_args is None:
            out = compiled.fn(*[value._local_tensor if type(value) is cls else value for value in args], **kwargs)
        else:       # e.g. view: the local sizes replace the global ones; specs stand for the DTensors in order
            locals_ = iter([dt._local_tensor for dt in dtensors])
            out = compiled.fn(*[next(locals_) if type(value) is DTensorSpec else value for value in local_args],
                              **kwargs)
        spec = compiled.output_specs[0]
        wrapped = _make_wrapper_subclass(cls, spec.shape, strides=spec.stride, dtype=spec.dtype, device=out.device)
        wrapped._local_tensor = out
        wrapped._spec = spec
        if compiled.returns_view and dtensors[0]._gathered_view is not None:
            _view_of_view(wrapped, compiled, _direct_call_args(cls, args, dtensors, compiled), kwargs, dtensors)
        return wrapped
    if path is _DIRECT_SELF:         # in-place ops
        compiled.fn(*[value._local_tensor if type(value) is cls else value for value in args], **kwargs)
        if args[0]._gathered_view is not None:
            _write_through(args[0], compiled.op)
        return args[0]
    return _execute(cls, args, kwargs, dtensors, plain, compiled)


_DIRECT, _DIRECT_ONE, _DIRECT_SELF = Path.DIRECT, Path.DIRECT_ONE, Path.DIRECT_SELF
_make_wrapper_subclass = Tensor._make_wrapper_subclass


def _first_call(cls: type, op: OpOverload, types: tuple, args: tuple, kwargs: dict, key: tuple | None,
                dtensors: list, plain: list[Tensor]) -> Any:
    """A call without a cache entry: out= variants and plain tensors first, then compile, cache and run."""
    out_args = op_info(op).out_args
    if out_args:
        functional = functional_of(op, out_args)
        if functional is not None:
            return _run_out_variant(cls, op, functional, args, kwargs, out_args)
    if plain and (op in _PLAIN_AS_REPLICATE or _implicitly_replicated.get() or _in_backward()
                  or _one_value_broadcast(plain)):
        args = _replicate_plain(cls, args, dtensors[0]._spec.mesh)
        return dispatch(cls, op, types, args, kwargs)
    if op._schema.name.startswith("aten::_foreach_") and (plain or len({dt._spec.mesh for dt in dtensors}) > 1):
        split = _foreach_by_mesh(op, args, kwargs, cls)
        if split is not _NOT_SPLIT:
            return split
    for tensor in plain:
        if tensor.numel() != 1:
            raise MixedTensorError(
                f"{where(op, tuple(dt._spec for dt in dtensors))}: got a plain torch.Tensor of shape "
                f"{tuple(tensor.shape)} beside DTensors; its layout is ambiguous. Make it a DTensor first "
                f"(distribute_tensor(t, mesh, placements) or DTensor.from_local(...)), or, for a value equal on "
                f"every rank, run the op under spmd.tensor.experimental.implicit_replication(). Only "
                f"one-element plain tensors (or one element broadcast) are treated as replicated scalars.")
    compiled = compile_call(op, args, kwargs, dtensors, plain, cls)
    if key is not None:
        mesh = dtensors[0]._spec.mesh
        cache = mesh.dispatch_cache
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = compiled
        _MESHES_WITH_DECISIONS.add(mesh)
    return _execute(cls, args, kwargs, dtensors, plain, compiled)


_MESHES_WITH_DECISIONS: weakref.WeakSet = weakref.WeakSet()


def _one_value_broadcast(plain: list[Tensor]) -> bool:
    """Whether the plain tensors are one-element ones and at least one element broadcast to a shape (every stride
    0), which is as unambiguous as a one-element tensor: torch's `x[i] = 0` on an accelerator copies a 0-d tensor
    expanded to the slice's shape (on the CPU it fills)."""
    def one_value(tensor: Tensor) -> bool:
        return tensor.numel() > 0 and all(stride == 0 for stride, size in zip(tensor.stride(), tensor.shape)
                                          if size > 1)
    return any(tensor.numel() > 1 for tensor in plain) and all(one_value(tensor) for tensor in plain)


def forget_decisions() -> None:
    """Drop every cached decision of every live mesh: after a rule changed (rules.override_rule), so that the
    next call of each op decides again."""
    for mesh in list(_MESHES_WITH_DECISIONS):
        mesh.dispatch_cache.clear()


# Note: foreach ops over several meshes
# An optimizer's foreach ops take every parameter of a group in one list, and the parameters may live on different
# meshes (under FSDP over tensor parallelism, plain parameters on the dp mesh beside (dp, tp) ones), or be plain
# tensors beside DTensors (a model whose tensor-parallel plan leaves some parameters alone: torch's optimizers
# step with foreach by default on accelerators, so every step there makes such calls). The operands at one list
# position share a mesh, or are all plain, so such a call runs as one call per mesh and one on the plain
# positions (each decided and cached as usual), and the outputs go back in list order: torch's DTensor allows the
# meshes, not the plain tensors. A call that doesn't split so cleanly (a position holding a plain tensor beside a
# DTensor or DTensors of two meshes, a DTensor outside the lists) goes on to compile_call, which names the meshes
# or the plain tensor.

_NOT_SPLIT = object()
_PLAIN_POSITION = object()      # _foreach_by_mesh's key for the positions of plain tensors


def _foreach_by_mesh(op: OpOverload, args: tuple, kwargs: dict, cls: type) -> Any:
    """Run foreach `op` once per mesh of its list positions (see Note: foreach ops over several meshes), or
    return _NOT_SPLIT."""
    lists = [k for k, value in enumerate(args) if isinstance(value, (list, tuple))]
    tensor_lists = [k for k in lists if any(isinstance(item, Tensor) for item in args[k])]
    if not tensor_lists or any(isinstance(v, cls) for k, v in enumerate(args) if k not in lists) \
            or any(isinstance(v, (Tensor, list, tuple)) for v in kwargs.values()):
        return _NOT_SPLIT
    length = len(args[tensor_lists[0]])
    if any(len(args[k]) != length for k in lists):
        return _NOT_SPLIT
    positions: dict[Any, list[int]] = {}
    for i in range(length):
        items = [args[k][i] for k in tensor_lists if args[k][i] is not None]
        meshes = {item._spec.mesh for item in items if isinstance(item, cls)}
        if not meshes:              # no DTensor at this position: plain tensors (parameters too) and scalars
            positions.setdefault(_PLAIN_POSITION, []).append(i)
            continue
        if len(meshes) != 1 or any(type(item) is not cls for item in items):
            return _NOT_SPLIT
        positions.setdefault(meshes.pop(), []).append(i)
    if len(positions) < 2:
        return _NOT_SPLIT
    results: list[Any] = [None] * length
    returned = False
    for where_ in positions.values():
        sub = tuple([value[i] for i in where_] if k in lists else value for k, value in enumerate(args))
        out = op(*sub, **kwargs)
        if out is not None:
            returned = True
            for i, item in zip(where_, out, strict=True):
                results[i] = item
    return results if returned else None


def _execute(cls: type, args: tuple, kwargs: dict, dtensors: list, plain: list[Tensor], compiled: Compiled) -> Any:
    """Run a decided call on its path (see Path; dispatch runs DIRECT_ONE and DIRECT_SELF hits inline)."""
    path = compiled.path
    if path is _DIRECT_ONE or path is _DIRECT_SELF or path is _DIRECT:
        if compiled.local_args is not None:     # see dispatch
            locals_ = iter([dt._local_tensor for dt in dtensors])
            call_args = [next(locals_) if type(value) is DTensorSpec else value for value in compiled.local_args]
        elif compiled.list_args:                # a foreach op: lists of DTensors
            lists = compiled.list_args
            call_args = [[item._local_tensor for item in value] if index in lists else
                         value._local_tensor if type(value) is cls else value for index, value in enumerate(args)]
        else:
            call_args = [value._local_tensor if type(value) is cls else value for value in args]
        out = compiled.fn(*call_args, **kwargs)
        if compiled.mutated:
            _write_through_mutated(dtensors, compiled)
        if path is _DIRECT_SELF:
            return args[0]
        result = _wrap(cls, out, args, kwargs, compiled)
        if compiled.returns_view and dtensors[0]._gathered_view is not None:
            _view_of_view(result, compiled, call_args, kwargs, dtensors)
        return result
    if path is Path.FALLBACK:
        return _run_fallback(cls, compiled.op, args, kwargs, dtensors, plain, compiled)
    return _run(cls, args, kwargs, dtensors, plain, compiled)


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
            raise MixedTensorError(f"{where(op, specs)}: an out= argument and the result must both be DTensors, "
                                   f"got {type(out).__name__} for a {type(value).__name__} result")
        _write_out(out, value)
        if out._gathered_view is not None:
            _write_through(out, op)
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


def _run(cls: type, args: tuple, kwargs: dict, dtensors: list, plain: list[Tensor], compiled: Compiled) -> Any:
    """The general path: redistribute the inputs, substitute local tensors anywhere in the arguments, run."""
    locals_ = _local_inputs(dtensors, compiled)
    local_args = compiled.local_args if compiled.local_args is not None else args
    local_kwargs = compiled.local_kwargs if compiled.local_kwargs is not None else kwargs
    local_iter, plain_iter = iter(locals_), iter(plain)
    call_args = [substitute(a, cls, DTensorSpec, local_iter, plain_iter) for a in local_args]
    call_kwargs = {k: substitute(v, cls, DTensorSpec, local_iter, plain_iter) for k, v in local_kwargs.items()}
    out = compiled.fn(*call_args, **call_kwargs)
    if compiled.inplace_view:
        self_ = args[0]
        self_._spec = compiled.output_specs[0]
        with no_dispatch():
            compiled.op._op(*args, **kwargs)
    elif compiled.mutated:
        _write_through_mutated(dtensors, compiled)
    result = _wrap(cls, out, args, kwargs, compiled)
    if compiled.returns_view:
        moved = [k for k, dt in enumerate(dtensors) if locals_[k] is not dt._local_tensor]
        if moved:
            _view_of_gathered(result, compiled, dtensors, locals_[0], call_args, call_kwargs)
        elif dtensors[0]._gathered_view is not None:
            _view_of_view(result, compiled, call_args, call_kwargs, dtensors)
    return result


def _local_inputs(dtensors: list, compiled: Compiled) -> list[Tensor]:
    """The local tensors the op gets, in input order: each DTensor input redistributed to its target
    (collective). An input passed twice is moved once. Written inputs are reduced in place (see Note: in-place
    ops on Partial tensors); read inputs in `compiled.adopt` take their reduced layout (OpOptions)."""
    moved: dict[tuple[int, Placements], Tensor] = {}
    locals_ = []
    for k, (dt, target) in enumerate(zip(dtensors, compiled.input_targets)):
        local = dt._local_tensor
        if target is None:
            locals_.append(local)
        elif k in compiled.reduce_in_place:
            local.copy_(run_plan(local, dt._spec, target))
            dt._spec = dt._spec.with_placements(target)
            locals_.append(local)
        else:
            local = moved.get((id(dt), target))
            if local is None:
                local = moved[(id(dt), target)] = run_plan(dt._local_tensor, dt._spec, target)
            locals_.append(local)
    if compiled.adopt:
        written = {id(dtensors[k]) for k in compiled.mutated}
        for k in compiled.adopt:
            dt, target = dtensors[k], compiled.input_targets[k]
            if id(dt) not in written and dt._spec.placements != target:    # a written tensor keeps its own
                dt._local_tensor = moved[(id(dt), target)]
                dt._spec = dt._spec.with_placements(target)
    return locals_


def _wrap(cls: type, out: Any, args: tuple, kwargs: dict, compiled: Compiled) -> Any:
    """The call's result: the written arguments it returns, or its local outputs wrapped as DTensors."""
    if compiled.returns_mutated is not None:
        returned = [args[w] if isinstance(w, int) else kwargs[w] for w in compiled.returns_mutated]
        if not returned:
            return None if out is None else out
        return returned[0] if compiled.single_output and len(returned) == 1 else tuple(returned)
    if compiled.single_output:
        spec = compiled.output_specs[0]
        return out if spec is None else _wrap_one(cls, out, spec)
    wrapped = [item if spec is None else _wrap_one(cls, item, spec) for item, spec in zip(out, compiled.output_specs)]
    return type(out)(wrapped) if isinstance(out, tuple) else wrapped


def _wrap_one(cls: type, local: Tensor, spec: DTensorSpec) -> Any:
    """cls._wrap_local, inlined (this is per output per call)."""
    wrapped = _make_wrapper_subclass(cls, spec.shape, strides=spec.stride, dtype=spec.dtype, device=local.device)
    wrapped._local_tensor = local
    wrapped._spec = spec
    return wrapped


def _draw_from_the_ranks_generator(op: OpOverload, call_args: list, call_kwargs: dict, device: torch.device) -> None:
    """A random op the fallback runs (multinomial, normal of tensors, poisson, rrelu_with_noise) draws from this
    rank's DTensor generator, as the random ops with handlers do (spmd.tensor.random): the one-process run's
    numbers, the same on every rank. Fills the op's `generator` argument where the caller left it None."""
    generator = get_generator(device)
    names = [argument.name for argument in op._schema.arguments]
    if generator is None or "generator" not in names:
        return
    index = names.index("generator")
    if index < len(call_args) and not op._schema.arguments[index].kwarg_only:
        if call_args[index] is None:
            call_args[index] = generator
    elif call_kwargs.get("generator") is None:
        call_kwargs["generator"] = generator


def _run_fallback(cls: type, op: OpOverload, args: tuple, kwargs: dict, dtensors: list, plain: list[Tensor],
                  compiled: Compiled) -> Any:
    """Replicate-compute-reshard (see the rules module docstring); writes mutated inputs back."""
    note_fallback(op)
    mesh = dtensors[0]._spec.mesh
    full_locals = [run_plan(dt._local_tensor, dt._spec, _replicated(mesh.ndim)) for dt in dtensors]
    local_iter, plain_iter = iter(full_locals), iter(plain)
    call_args = [substitute(a, cls, DTensorSpec, local_iter, plain_iter) for a in args]
    call_kwargs = {k: substitute(v, cls, DTensorSpec, local_iter, plain_iter) for k, v in kwargs.items()}
    if torch.Tag.nondeterministic_seeded in op.tags:
        _draw_from_the_ranks_generator(op, call_args, call_kwargs, full_locals[0].device)
    out = op(*call_args, **call_kwargs)
    for position in mutated_positions(op, args, kwargs, cls):
        dt, full = dtensors[position], full_locals[position]
        if full is not dt._local_tensor:
            dt._local_tensor.copy_(dt._spec.local_from_full(full))
        if dt._gathered_view is not None:
            _write_through(dt, op)
    if compiled.returns_mutated is not None:
        return _wrap(cls, out, args, kwargs, compiled)
    first = dtensors[0]._spec
    keep_alias = op_info(op).returns_view and all(full is dt._local_tensor for dt, full in zip(dtensors, full_locals))

    def reshard(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        if value.layout is not torch.strided:
            raise ShardingError(f"{where(op, tuple(dt._spec for dt in dtensors))}: the op returns a {value.layout} "
                                f"tensor, and a DTensor holds dense (strided) tensors; call it on a plain tensor "
                                f"(dtensor.full_tensor() or .to_local())")
        # a view of replicas stays their view (a write through it reaches them), strides and all; but not the
        # conjugate or negative views (_conj, _neg_view), whose bits a wrapper can't carry
        if keep_alias and not (value.is_conj() or value.is_neg()):
            spec = DTensorSpec(mesh, _replicated(mesh.ndim), value.shape, tuple(value.stride()), value.dtype)
            return cls._wrap_local(value, spec)
        stride = contiguous_stride(value.shape)
        value = values_of(value)
        if value.shape == first.shape and not first.has_partial():
            spec = DTensorSpec(mesh, first.placements, value.shape, stride, value.dtype)
            return cls._wrap_local(spec.local_from_full(value), spec)
        spec = DTensorSpec(mesh, _replicated(mesh.ndim), value.shape, stride, value.dtype)
        return cls._wrap_local(value.contiguous(), spec)

    result = type(out)(reshard(item) for item in out) if isinstance(out, (tuple, list)) else reshard(out)
    if compiled.returns_view and not keep_alias:      # copies, not views: a write through one can't reach its base
        for view in result if isinstance(result, (tuple, list)) else [result]:
            view._gathered_view = _GatheredView(dtensors[0], None, None, str(op))
    return result


# Note: writes through views of gathered copies
# A view op whose rule gathers its input (x[1] on a DTensor sharded on dim 0, x.diagonal() of a sharded dim) runs
# on a gathered copy of the input, so its result is a view of that copy, not of the DTensor. Such a result carries
# a _GatheredView: the DTensor it views (its base), the placements it was gathered to, and how to take the same
# view of a fresh gathering (`replay`; views of it extend the replay). An op that writes it (x[1] = 0 runs
# select, then fill_ on the select's result) writes its values through: the base is gathered anew, the view's
# region of that is overwritten with the written view's local values, and the base takes its own placements of
# the result back (a local slice after a gather: no communication). Every rank runs it, as every rank ran the
# write. So a write through such a view changes exactly the viewed elements of the base, as on a plain tensor
# (torch's DTensor drops these writes). A view that gathered a view of a gathered copy (x[1, 2] on a DTensor
# sharded on both dims) has that view as its base: the base is first brought up to date from its own base, then
# written through in turn. Where the view can't be replayed (a view op without a rule, which ran through the
# fallback's copies, or one of two DTensors), the write is refused, naming the op. Reads through such a view see
# the base as it was when the view was taken (as in torch's DTensor): a view of a sharded dim is a snapshot for
# reading, and a window for writing.


class _GatheredView:
    """Where a write through a view of a gathered copy goes (see Note: writes through views of gathered copies)."""

    __slots__ = ("base", "made_by", "replay", "target")

    def __init__(self, base: Any, target: Placements | None, replay: Any, made_by: str) -> None:
        self.base, self.target, self.replay, self.made_by = base, target, replay, made_by

    def then(self, step: Any, made_by: str) -> _GatheredView:
        """The same base, viewed further by `step` (a local view function), or unwritable when `step` is None."""
        replay = self.replay
        if replay is None or step is None:
            return _GatheredView(self.base, self.target, None, made_by)
        return _GatheredView(self.base, self.target, lambda full: step(replay(full)), made_by)


def _view_of_gathered(result: Any, compiled: Compiled, dtensors: list, gathered: Tensor, call_args: list,
                      call_kwargs: dict) -> None:
    """Mark the outputs of a view op that ran on a gathered copy of its input (see the Note)."""
    made_by = str(compiled.op)
    writable = len(dtensors) == 1

    def replay(full: Tensor) -> Any:
        return compiled.fn(*[full if value is gathered else value for value in call_args], **call_kwargs)

    for index, view in _outputs(result):
        pick = replay if index is None else (lambda full, index=index: replay(full)[index])
        view._gathered_view = _GatheredView(dtensors[0], compiled.input_targets[0], pick if writable else None,
                                            made_by)


def _view_of_view(result: Any, compiled: Compiled, call_args: list, call_kwargs: dict, dtensors: list) -> None:
    """Mark the outputs of a view op whose input is itself a view of a gathered copy (see the Note): the same
    base, viewed one step further. `call_args` are the op's local call, holding the input's local tensor."""
    parent = dtensors[0]._local_tensor

    def step(local: Tensor) -> Any:
        return compiled.fn(*[local if value is parent else value for value in call_args], **call_kwargs)

    for index, view in _outputs(result):
        pick = step if index is None else (lambda local, index=index: step(local)[index])
        view._gathered_view = dtensors[0]._gathered_view.then(pick if len(dtensors) == 1 else None, str(compiled.op))


def _direct_call_args(cls: type, args: tuple, dtensors: list, compiled: Compiled) -> list:
    """The local call a DIRECT_ONE hit made (dispatch builds it inline)."""
    if compiled.local_args is None:
        return [value._local_tensor if type(value) is cls else value for value in args]
    locals_ = iter([dt._local_tensor for dt in dtensors])
    return [next(locals_) if type(value) is DTensorSpec else value for value in compiled.local_args]


def _outputs(result: Any) -> list[tuple[int | None, Any]]:
    if isinstance(result, (tuple, list)):
        return [(index, view) for index, view in enumerate(result) if hasattr(view, "_gathered_view")]
    return [(None, result)]


def _write_through_mutated(dtensors: list, compiled: Compiled) -> None:
    for position in compiled.mutated:
        if dtensors[position]._gathered_view is not None:
            _write_through(dtensors[position], compiled.op)


def _write_through(view: Any, op: Any) -> None:
    """`view` was just written by `op`: its values go to the DTensor it views (see the Note). Collective."""
    gathered = view._gathered_view
    base = gathered.base
    if gathered.replay is None:
        raise ShardingError(
            f"{where(op, (view._spec,))}: this DTensor is a copy of part of another DTensor (taken by "
            f"{gathered.made_by} on a copy of its input: a view op without a sharding rule, or over two DTensors), "
            f"so the write can't reach the DTensor it views; redistribute that DTensor to Replicate before taking "
            f"the view, or write with an op on the whole tensor (torch.where, index_put_)")
    if base._gathered_view is not None:      # itself a view of a gathered copy: bring it up to date first
        _refresh(base)
    fresh = run_plan(base._local_tensor, base._spec, gathered.target)
    gathered.replay(fresh).copy_(view._local_tensor)
    base._local_tensor.copy_(run_plan(fresh, base._spec.with_placements(gathered.target), base._spec.placements))
    if base._gathered_view is not None:
        _write_through(base, op)


def _refresh(view: Any) -> None:
    """`view`'s local values taken anew from the DTensor it views (before a write through it lands on them, so
    that writing all of it back changes nothing else). Collective."""
    gathered = view._gathered_view
    base = gathered.base
    if gathered.replay is None:
        return
    if base._gathered_view is not None:
        _refresh(base)
    view._local_tensor.copy_(gathered.replay(run_plan(base._local_tensor, base._spec, gathered.target)))


def local_as(dtensor: Any, placements: Placements) -> Tensor:
    """`dtensor`'s local tensor laid out as `placements` (for handlers; collective over the mesh when it moves)."""
    return run_plan(dtensor._local_tensor, dtensor._spec, tuple(placements))


def _replicated(ndim: int) -> Placements:
    return (Replicate(),) * ndim
