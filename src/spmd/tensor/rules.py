"""The sharding-rule registry: how each aten op decides its input and output placements; and the fallback.

Layer: tensor. Pure decisions on metadata; nothing here communicates or touches tensor data.

How an op on DTensors runs (the dispatch package does this; a rule only decides):
  1. dispatch replaces every DTensor argument by its DTensorSpec and builds an `OpSchema`;
  2. the op's rule returns a `ShardingDecision`: the placements each DTensor input must be redistributed to,
     and the placements of each output; dispatch checks it (one entry per input and per output, valid
     placements, written inputs kept) and computes the outputs' GLOBAL shape/stride/dtype by running the op
     on meta tensors;
  3. dispatch redistributes the inputs (cheapest collectives), runs the local op (the op itself, or the
     op's kernel: see `kernel=` below) on the local tensors, and wraps the outputs as DTensors.
Decisions are cached per (op, input specs, non-tensor arguments), so a rule runs once per distinct call and
may be slow-ish; it must be a pure function of its schema (it may read `schema.mesh` and its coordinate).

Writing a rule
==============
Four ways to register, from simplest to most general. Import from `spmd.tensor.rules`:

1. `@register_strategy(*ops)` with `fn(schema) -> list[Strategy]`: list the placements that work on ONE mesh
   dim. Each `Strategy(inputs, output)` gives the placement every DTensor input needs on that mesh dim
   (`inputs`, aligned with `schema.input_specs`) and the placement of the output (`output`; a tuple with one
   entry per output for ops returning several tensors, None for a non-tensor output). The framework picks, for
   every mesh dim independently, the strategy whose input redistribution is cheapest (bytes moved, see
   `transition_cost`); ties go to the EARLIER strategy, so list your preferred ones first. Strategies whose
   input placement is impossible (Shard of a dim the input lacks) are your job to leave out. This handles
   N-d meshes for free: a (2, 2) mesh picks one strategy for mesh dim 0 and one for mesh dim 1.

   Worked example, the rule for `aten.add.Tensor` on two same-shape tensors (ops/pointwise.py has the real,
   broadcasting one):

       from torch import ops
       from spmd.tensor.placement import Partial, Replicate, Shard
       from spmd.tensor.rules import OpSchema, Strategy, register_strategy

       @register_strategy(ops.aten.add.Tensor)
       def _add(schema: OpSchema) -> list[Strategy]:
           a, b = schema.input_specs                      # DTensorSpec of self and other
           ndim = a.ndim
           return [Strategy((Replicate(), Replicate()), Replicate()),
                   *[Strategy((Shard(d), Shard(d)), Shard(d)) for d in range(ndim)],
                   Strategy((Partial(), Partial()), Partial())]   # sum distributes over +

   On a 1-d mesh with a = Shard(0), b = Replicate(): Replicate costs an all-gather of `a`; Shard(0) costs only
   a local chunk of `b` (nearly free); Partial costs infinity (a Shard can't become Partial) -> Shard(0).
   Keep only candidates that are mathematically right: e.g. `Partial + Python scalar` is NOT Partial.

2. `@register_rule(*ops)` with `fn(schema) -> ShardingDecision`: decide everything yourself. Use it when the
   choice is not per-mesh-dim, or when the local op needs different non-tensor arguments than the global one
   (a `view` of a sharded tensor needs the LOCAL sizes): return them in `local_args` / `local_kwargs`, written
   like `schema.args` (DTensorSpec where a DTensor goes, plain tensors where plain tensors go). Helpers:
   `pick_per_mesh_dim(schema, strategies)` (what register_strategy calls), `transition_cost`,
   `redistribute_cost`, `replicated(mesh)`, and on a spec: `local_shape()`, `shard_mesh_dims(dim)`.

3. `register_family(predicate, rule)`: one rule for every op matching `predicate(op)` that has no rule of its
   own (ops/pointwise.py uses it for every op tagged torch.Tag.pointwise); `numbers_matter=` a predicate on
   the op, for the option of that name below.

4. `@register_handler(*ops)` with `fn(op, args, kwargs) -> result`: full control, no caching; `args` hold
   the DTensors themselves. For ops that aren't a placement decision (random ops, `.item()`), or that are
   easiest written as other DTensor ops (call torch functions on the DTensor args: they dispatch again).

Options of register_rule / register_strategy (see `OpOptions`):
- `kernel=make_kernel`: for an op whose local computation is not the op itself (a mean over a sharded dim is
  a local sum over the GLOBAL count; a vocab-sharded embedding masks the ids other ranks hold). Once per
  distinct call, after the decision is checked, dispatch calls `make_kernel(LocalPlan)` (the call's schema,
  the specs of the local inputs after redistribution, the output specs) and caches the function it returns;
  every such call then runs it in place of the op, with the call's arguments, DTensors replaced by local
  tensors, and wraps what it returns (a local tensor per output, laid out as the output specs say). It may
  communicate (an all-reduce of a local statistic). Return `plan.op` where the op itself is right.
- `numbers_matter=False`: neither the rule nor the kernel factory reads the Python-number arguments (only
  their types), so calls differing only in them share one decision: an optimizer's step-dependent scalars
  would otherwise make every step a cache miss.
- `adopt_reduced_partials=True`: a Partial input the decision reduces (one the op reads, not writes) keeps
  its reduced layout afterwards, in place (same global value), so later ops don't reduce it again.

Contract for rules (all kinds):
- Input placements: one entry per DTensor input (`schema.input_specs` order: positional args, then keyword
  args, entering lists in order), a placements tuple (one Placement per mesh dim) or None to keep it.
- In-place ops (a mutated input, e.g. `add_`, `_foreach_mul_`): mutated inputs can't change placements; keep
  them (None or their own placements) and give the output(s) the same placements. Other inputs may move.
  The DTensor returned for an aliased output is the mutated input object itself.
- Partial: only produce a Partial output where the math is linear in that input (sum of Partials,
  Partial * Replicate, reductions over a sharded dim, ...). A non-linear op must require Replicate (or Shard)
  for a Partial input; the framework then all-reduces (or reduce-scatters) it.
- Raise `ShardingError(message)` for a combination you can't support: dispatch adds the op name and specs.
- Output shapes are NOT the rule's job: dispatch runs the op on meta tensors with the global shapes.

Fallback: an op with no rule and no handler runs replicate-compute-reshard (all inputs redistributed to
Replicate, the op run on full values, each output left Replicate, or re-chunked to the first input's
placements when it has that input's shape) and warns once, naming the op. Mutated inputs are written back.
`record_fallbacks()` lists, per rank, every op that took the fallback (the warning says it once per process).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch._ops import OpOverload

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.spec import DTensorSpec, Placements

if TYPE_CHECKING:
    from spmd.device_mesh import DeviceMesh

OutputPlacements = Placements | Sequence[Placements | None] | None


class ShardingError(ValueError):
    """A rule can't shard this combination of inputs; dispatch re-raises it naming the op and the specs."""


@dataclasses.dataclass(frozen=True)
class OpSchema:
    """One call of an aten op, with every DTensor argument replaced by its DTensorSpec.

    `args`/`kwargs` keep every other value (Python scalars, dtypes, plain scalar tensors); a list of DTensors
    becomes a list of specs. `input_specs` lists every spec in order (positional args, then kwargs, lists
    entered in order): it is the order of `ShardingDecision.input_placements` and `Strategy.inputs`.
    """

    op: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    input_specs: tuple[DTensorSpec, ...]

    @property
    def mesh(self) -> DeviceMesh:
        return self.input_specs[0].mesh

    def __repr__(self) -> str:
        return f"{self.op}({', '.join(map(repr, self.args))}{', ' if self.kwargs else ''}{self.kwargs or ''})"


@dataclasses.dataclass(frozen=True)
class ShardingDecision:
    """What a rule decided.

    output_placements: the output's placements (one Placement per mesh dim) for an op returning one tensor;
        for an op returning several values, a sequence with one entry per value (None for a non-tensor);
        None when the op returns nothing.
    input_placements: one entry per `schema.input_specs` item: the placements that input must be redistributed
        to before the local op runs, or None to keep it. None for the whole field keeps every input.
    local_args / local_kwargs: replacement arguments for the local op (same form as schema.args/kwargs), or
        None to use the call's own. For ops whose non-tensor arguments depend on the local shard (view sizes).
    """

    output_placements: OutputPlacements
    input_placements: Sequence[Placements | None] | None = None
    local_args: tuple[Any, ...] | None = None
    local_kwargs: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to shard an op on ONE mesh dim: each DTensor input's placement there, and the output's.

    `output` is one Placement for a single-tensor op, or a tuple (one entry per output, None for non-tensors).
    """

    inputs: tuple[Placement, ...]
    output: Placement | tuple[Placement | None, ...] | None


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


Rule = Callable[[OpSchema], ShardingDecision]
StrategyFn = Callable[[OpSchema], Sequence[Strategy]]
Handler = Callable[[OpOverload, tuple[Any, ...], dict[str, Any]], Any]
LocalKernel = Callable[..., Any]
KernelFactory = Callable[[LocalPlan], LocalKernel]


@dataclasses.dataclass(frozen=True)
class OpOptions:
    """How dispatch runs an op beyond its rule's decision (see "Options of register_rule" above)."""

    kernel: KernelFactory | None = None     # builds the local function from a LocalPlan; None: the op itself
    numbers_matter: bool = True             # False: Python numbers are keyed by type only
    adopt_reduced_partials: bool = False    # a reduced Partial input keeps the reduced layout


RULES: dict[OpOverload, Rule] = {}
OPTIONS: dict[OpOverload, OpOptions] = {}   # only ops registered with options; the rest run with OpOptions()
NUMBERS_BY_VALUE: dict[Any, bool] = {}   # op._op -> numbers_by_value(op), filled on first sight: read per call,
                                         # and op._op hashes in C (an OpOverload's hash is a Python call)
HANDLERS: dict[OpOverload, Handler] = {}
_FAMILIES: list[tuple[Callable[[OpOverload], bool], Rule, Callable[[OpOverload], bool]]] = []
_FAMILY_RULES: dict[OpOverload, tuple[Rule, bool] | None] = {}   # op -> (its family's rule, numbers matter)


def _check_new(op: object) -> None:
    if not isinstance(op, OpOverload):
        raise TypeError(f"register a rule on an OpOverload such as torch.ops.aten.add.Tensor, got {op!r}")
    if op in RULES or op in HANDLERS:
        raise ValueError(f"{op} already has a sharding rule or handler; each op gets exactly one")


def _register(ops: Sequence[OpOverload], rule: Rule, options: OpOptions) -> None:
    for op in ops:
        _check_new(op)
    for op in ops:
        RULES[op] = rule
        if options != _DEFAULT_OPTIONS:
            OPTIONS[op] = options
    NUMBERS_BY_VALUE.clear()


def register_rule(*ops: OpOverload, kernel: KernelFactory | None = None, numbers_matter: bool = True,
                  adopt_reduced_partials: bool = False) -> Callable[[Rule], Rule]:
    """Decorator: `fn(schema) -> ShardingDecision` decides the placements of `ops` (options: see OpOptions)."""
    options = OpOptions(kernel, numbers_matter, adopt_reduced_partials)

    def decorate(fn: Rule) -> Rule:
        _register(ops, fn, options)
        return fn
    return decorate


def register_strategy(*ops: OpOverload, kernel: KernelFactory | None = None, numbers_matter: bool = True,
                      adopt_reduced_partials: bool = False) -> Callable[[StrategyFn], StrategyFn]:
    """Decorator: `fn(schema) -> list[Strategy]` lists per-mesh-dim candidates; the cheapest is chosen per dim
    (options: see OpOptions)."""
    options = OpOptions(kernel, numbers_matter, adopt_reduced_partials)

    def decorate(fn: StrategyFn) -> StrategyFn:
        def rule(schema: OpSchema) -> ShardingDecision:
            return pick_per_mesh_dim(schema, fn(schema))
        _register(ops, rule, options)
        return fn
    return decorate


def override_rule(op: OpOverload, rule: Rule) -> None:
    """Make `rule` the rule of `op`, replacing its own or its family's (with their options): for user-registered
    shardings (spmd.tensor.experimental.register_sharding). An op run by a handler is refused. Decisions
    already cached for `op` are stale afterwards: the caller clears the dispatch caches."""
    if not isinstance(op, OpOverload):
        raise TypeError(f"register a sharding on an OpOverload such as torch.ops.aten.add.Tensor, got {op!r}")
    if op in HANDLERS:
        raise ValueError(f"{op} runs through a handler of spmd's own (not a sharding rule); it can't be given a "
                         f"sharding")
    RULES[op] = rule
    OPTIONS.pop(op, None)
    NUMBERS_BY_VALUE.clear()


def register_handler(*ops: OpOverload) -> Callable[[Handler], Handler]:
    """Decorator: `fn(op, args, kwargs)` runs `ops` on DTensors itself (no caching, full control)."""
    def decorate(fn: Handler) -> Handler:
        for op in ops:
            _check_new(op)
            HANDLERS[op] = fn
        return fn
    return decorate


_OVERRIDE_LOCK = threading.Lock()
_OVERRIDE_USERS: dict[tuple[OpOverload, Handler], int] = {}


@contextlib.contextmanager
def overriding_handlers(handlers: dict[OpOverload, Handler]) -> Iterator[None]:
    """Install `handlers` over these ops' rules while any thread is inside (entries are counted, so thread ranks
    may enter and leave in any order). A handler sees every rank's calls: for those it does not take (a thread
    outside its context) it calls `dispatch(..., by_rule=True)`. Ops with a handler of their own are refused."""
    with _OVERRIDE_LOCK:
        for op, handler in handlers.items():
            if op in HANDLERS and (op, HANDLERS[op]) not in _OVERRIDE_USERS:
                raise ValueError(f"{op} has a handler of its own; it can't be overridden")
            if op in HANDLERS and HANDLERS[op] is not handler:
                raise ValueError(f"{op} is already overridden by another handler")
        for op, handler in handlers.items():
            _OVERRIDE_USERS[(op, handler)] = _OVERRIDE_USERS.get((op, handler), 0) + 1
            HANDLERS[op] = handler
    try:
        yield
    finally:
        with _OVERRIDE_LOCK:
            for op, handler in handlers.items():
                left = _OVERRIDE_USERS.pop((op, handler)) - 1
                if left:
                    _OVERRIDE_USERS[(op, handler)] = left
                else:
                    del HANDLERS[op]


def register_family(predicate: Callable[[OpOverload], bool], rule: Rule, *,
                    numbers_matter: Callable[[OpOverload], bool] = lambda op: True) -> None:
    """Use `rule` for every op without its own rule or handler for which `predicate(op)` is true (e.g. every op
    tagged torch.Tag.pointwise). Families are tried in registration order; explicit registrations win.
    `numbers_matter(op)`: register_rule's numbers_matter for each op of the family."""
    _FAMILIES.append((predicate, rule, numbers_matter))
    _FAMILY_RULES.clear()
    NUMBERS_BY_VALUE.clear()


def op_options(op: OpOverload) -> OpOptions:
    """How dispatch runs `op` beyond its rule: its kernel factory and keying options (defaults if none)."""
    return OPTIONS.get(op, _DEFAULT_OPTIONS)


_DEFAULT_OPTIONS = OpOptions()


def lookup_rule(op: OpOverload) -> Rule | None:
    """The rule for `op`: its own, else its family's, else None (the fallback runs)."""
    rule = RULES.get(op)
    if rule is not None:
        return rule
    family = _family(op)
    return None if family is None else family[0]


def _family(op: OpOverload) -> tuple[Rule, bool] | None:
    if op not in _FAMILY_RULES:
        _FAMILY_RULES[op] = next(((rule, numbers_matter(op)) for predicate, rule, numbers_matter in _FAMILIES
                                  if predicate(op)), None)
    return _FAMILY_RULES[op]


def numbers_by_value(op: OpOverload) -> bool:
    """Whether the dispatch cache keys `op`'s Python-number arguments by value (its rule's numbers_matter), not
    by type alone. An op without a rule (the fallback) is keyed by value."""
    found = NUMBERS_BY_VALUE.get(op._op)
    if found is None:
        if op in RULES:
            found = op_options(op).numbers_matter
        else:
            family = _family(op)
            found = family is None or family[1]
        NUMBERS_BY_VALUE[op._op] = found
    return found


# -- cost model ---------------------------------------------------------------------------------------------

# Fixed cost of one collective, in bytes-equivalent: makes "one collective fewer" win between near-equal plans.
COLLECTIVE_LATENCY_BYTES = 1024.0
# Cost of a local-only layout change (chunk a replica, partition a value): tiny, but more than keeping a layout.
LOCAL_CHANGE_COST = 1.0


def transition_cost(spec: DTensorSpec, mesh_dim: int, target: Placement) -> float:
    """Bytes moved per rank to change `spec`'s placement on `mesh_dim` to `target` (math.inf if unsupported).

    Ring costs with B = this rank's local bytes and n ranks on the mesh dim: all-gather (n-1)·B, all-reduce
    2(n-1)/n·B, reduce-scatter and all-to-all (n-1)/n·B, plus COLLECTIVE_LATENCY_BYTES per collective.
    Replicate -> Shard/Partial is a local change (LOCAL_CHANGE_COST). Shard -> Partial and Partial(a) ->
    Partial(b) are infinite: rules never choose them.
    """
    source = spec.placements[mesh_dim]
    if source == target:
        return 0.0
    n = spec.mesh.size(mesh_dim)
    if isinstance(source, Replicate):      # chunk or Partial.partition: local, no communication
        return LOCAL_CHANGE_COST
    if n == 1:
        return math.inf if isinstance(target, Partial) else LOCAL_CHANGE_COST
    local_bytes = spec.local_numel_estimate() * spec.dtype.itemsize
    if isinstance(source, Shard):
        if isinstance(target, Replicate):
            return COLLECTIVE_LATENCY_BYTES + (n - 1) * local_bytes
        if isinstance(target, Shard):
            return COLLECTIVE_LATENCY_BYTES + (n - 1) / n * local_bytes
        return math.inf
    if isinstance(target, Replicate):
        return COLLECTIVE_LATENCY_BYTES + 2 * (n - 1) / n * local_bytes
    if isinstance(target, Shard):
        return COLLECTIVE_LATENCY_BYTES + (n - 1) / n * local_bytes
    return math.inf


def redistribute_cost(spec: DTensorSpec, placements: Placements) -> float:
    """Approximate bytes moved per rank to redistribute `spec` to `placements` (sum over mesh dims)."""
    return sum(transition_cost(spec, i, target) for i, target in enumerate(placements))


def replicated(mesh: DeviceMesh) -> Placements:
    """All-Replicate placements for `mesh`."""
    return (Replicate(),) * mesh.ndim


def pick_per_mesh_dim(schema: OpSchema,
                      strategies: Sequence[Strategy] | Callable[[int], Sequence[Strategy]]) -> ShardingDecision:
    """For each mesh dim, choose the cheapest strategy (earliest on ties); assemble the ShardingDecision.

    `strategies` is one list for every mesh dim, or a function of the mesh dim returning that dim's list (for
    rules whose candidates depend on the inputs' placement there, e.g. in-place ops keeping self's).
    Raises ShardingError if no strategy is possible on some mesh dim (all need an unsupported transition).
    """
    specs = schema.input_specs
    chosen: list[Strategy] = []
    for mesh_dim in range(schema.mesh.ndim):
        candidates = strategies(mesh_dim) if callable(strategies) else strategies
        if not candidates:
            raise ShardingError(f"the rule listed no strategies for mesh dim {mesh_dim}")
        best, best_cost = None, math.inf
        for strategy in candidates:
            if len(strategy.inputs) != len(specs):
                raise ShardingError(f"strategy {strategy} has {len(strategy.inputs)} input placements for "
                                    f"{len(specs)} DTensor inputs")
            cost = 0.0
            for spec, target in zip(specs, strategy.inputs):
                cost += transition_cost(spec, mesh_dim, target)
                if cost >= best_cost:
                    break
            if cost < best_cost:
                best, best_cost = strategy, cost
        if best is None:
            have = [spec.placements[mesh_dim] for spec in specs]
            raise ShardingError(f"no strategy accepts inputs placed {have} on mesh dim {mesh_dim} (candidates: "
                                f"{[s.inputs for s in candidates]})")
        chosen.append(best)
    input_placements = []
    for k, spec in enumerate(specs):
        placements = tuple(strategy.inputs[k] for strategy in chosen)
        input_placements.append(None if placements == spec.placements else placements)
    first = chosen[0].output
    if first is None:
        return ShardingDecision(None, input_placements)
    if isinstance(first, Placement):
        return ShardingDecision(tuple(strategy.output for strategy in chosen), input_placements)
    outputs = [None if first[j] is None else tuple(strategy.output[j] for strategy in chosen)
               for j in range(len(first))]
    return ShardingDecision(outputs, input_placements)


# -- fallback -----------------------------------------------------------------------------------------------

_warned: set[OpOverload] = set()
_warned_lock = threading.Lock()
_recorders: contextvars.ContextVar[tuple[list[OpOverload], ...]] = contextvars.ContextVar(
    "spmd_fallback_recorders", default=())


@contextlib.contextmanager
def record_fallbacks() -> Iterator[list[OpOverload]]:
    """Collect every op that runs through replicate-compute-reshard on this rank while the block runs.

    Per rank, not per process: the list lives in the calling context, so with the threads transport each rank
    thread sees only its own fallbacks, and nested blocks each see all of theirs. Tests use it to turn a
    missing rule into a failure; a user can find the slow ops of a training step with it.

    >>> import torch
    >>> from spmd.testing import run_ranks
    >>> from spmd.tensor import Shard, distribute_tensor, init_device_mesh
    >>> def body(rank, world_size):
    ...     x = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (2,)), [Shard(0)])
    ...     with record_fallbacks() as fallbacks:
    ...         x + 1
    ...     return fallbacks
    >>> run_ranks(body, world_size=2)
    [[], []]
    """
    recorded: list[OpOverload] = []
    token = _recorders.set((*_recorders.get(), recorded))
    try:
        yield recorded
    finally:
        _recorders.reset(token)


def note_fallback(op: OpOverload) -> None:
    """`op` is about to run as replicate-compute-reshard: tell this rank's recorders, and warn once per op
    per process."""
    for recorded in _recorders.get():
        recorded.append(op)
    with _warned_lock:
        if op in _warned:
            return
        _warned.add(op)
    warnings.warn(f"spmd DTensor: {op} has no sharding rule; it ran as replicate-compute-reshard (every input "
                  f"all-gathered to a full replica). Give it a sharding with "
                  f"spmd.tensor.experimental.register_sharding to make it fast.",
                  stacklevel=3)
