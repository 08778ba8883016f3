"""Model and optimizer state dicts keyed by parameter FQNs, for any parallelism: the API of torch's DCP
`state_dict` module (get/set_model_state_dict, get/set_optimizer_state_dict, get/set_state_dict).

Layer: checkpoint (may import _core, comm, device_mesh, tensor); this module alone also imports the layer-4
parallelisms whose wrappers it sees through (ddp, fsdp).

Note: state dict keys
Every key is a canonical FQN: the name the parameter or buffer has in the plain model, as
`model.named_parameters()` gives it before any parallelism. DistributedDataParallel's `module.` component,
FullyShardedDataParallel's `_fsdp_wrapped_module.`, torch.compile's `_orig_mod.` and activation checkpointing's
`_checkpoint_wrapped_module.` are dropped; fully_shard and tensor parallelism keep the module tree, so their
names already are the plain ones; a pipeline stage's module has the FQNs of its part of the model. An
optimizer's state is keyed by those FQNs instead of parameter positions:
{"state": {fqn: {"step": ..., "exp_avg": ...}}, "param_groups": [{"params": [fqn, ...], "lr": ..., ...}]}; several
optimizers of one model merge into one dict (their parameters must be distinct). flatten_optimizer_state_dict=True
gives torch's flat form instead: {"state.<fqn>.<name>": value, "param_groups.<fqn>.<hyperparameter>": value}; set
accepts either form.

Note: layouts
get returns values as the model holds them: a DTensor stays a DTensor (its local shard), so a checkpointer can
save shards; the values are the live parameters and optimizer tensors (no copies), as in torch, so loading a
checkpoint into them in place and then calling set is the usual restore. full_state_dict=True turns every
DTensor into its full tensor (DTensor.full_tensor(), collective over its mesh); cpu_offload moves every tensor to
the CPU; with both, only global rank 0 keeps the values and every other rank gets {} (as torch, so that one host
copy of the model exists; every rank still takes part in the gathers).
set takes each value to the layout of the tensor it replaces in this model, whatever layout it arrives in:
  - a plain tensor where this model holds a DTensor is the full value: each rank keeps its piece (no
    communication; Shard, uneven torch.chunk pieces and FSDP-over-TP's _StridedShard alike);
  - a DTensor with other placements on an equal mesh is redistributed to this model's (collective over the mesh);
  - a DTensor where this model holds a plain tensor becomes its full tensor (collective over its mesh).
Anything else (a DTensor on another mesh, a global shape that differs) is an error naming the key. Model values
are copied into the parameters; optimizer values are copied into the optimizer's own state tensors, so the
state dict passed in never aliases the optimizer's state afterwards. A model whose tensors are on the meta device
(built on meta, then sharded) gets the loaded tensors assigned instead.

Note: a fresh optimizer's state
torch's optimizers create their state in their first step, but get and set need it to exist: get so that a
checkpointer can load into it in place, set so that full values can be sharded like the state they replace.
Both therefore initialise an optimizer that has no state and no gradients yet: every trainable parameter gets a
zero gradient and the optimizer steps once with lr and weight_decay set to zero (then restored, gradients
cleared), and every "step" counter it created is reset to 0. Parameters do not change (each update is scaled by
a zero lr), the moments stay zero (no weight decay leaks into them, as it would through a zero gradient), and for
Adam, AdamW and SGD the result is the state their first real step would have built before updating: a fresh
optimizer that went through get trains bit-identically to one that did not (torch's version of this trick
leaves step at 1). An optimizer whose other state evolves with every step even at zero gradients (NAdam's
mu_product, Adamax's eps floor) is initialised approximately.

Note: who calls what
Every function is called by every rank that holds the model, in the same order: full_state_dict gathers and
set's redistributions are collectives over each DTensor's mesh, taken key by key in state-dict order.
broadcast_from_rank0=True (set only; it needs full_state_dict=True): global rank 0 passes the full state dict,
the other ranks pass anything (it is ignored, {} will do). Over the default group:
  1. rank 0 broadcasts the dict's structure with every tensor replaced by its shape and dtype, and every other
     value by itself (broadcast_object_list);
  2. all ranks: for each tensor in order, rank 0 broadcasts it and every rank keeps only its piece in this
     model's layout before the next one, so no rank holds more than one full tensor besides rank 0;
  3. all ranks check the keys and load as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from spmd.comm.collectives import broadcast
from spmd.comm.objects import broadcast_object_list
from spmd.comm.world import current_world, get_rank, is_initialized
from spmd.ddp import DistributedDataParallel
from spmd.fsdp import FSDPModule
from spmd.fsdp.fully_sharded_data_parallel import WRAPPED, FullyShardedDataParallel
from spmd.fsdp.wrapper_config import StateDictType
from spmd.tensor import DTensor, distribute_tensor

__all__ = ["OptimizerStateType", "StateDictOptions", "ValueType", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]

ValueType = Any
OptimizerStateType = dict[str, Any]
Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]

_STATE = "state"
_GROUPS = "param_groups"
_PARAMS = "params"
_ZEROED_DURING_INIT = ("lr", "weight_decay")


@dataclasses.dataclass
class StateDictOptions:
    """How get_* and set_* treat the state dicts (torch's fields and defaults).

    - full_state_dict: get returns full tensors instead of DTensors (collective); see Note: layouts.
    - cpu_offload: get moves every tensor to the CPU; with full_state_dict only rank 0 keeps the values.
    - ignore_frozen_params: get leaves out parameters with requires_grad=False; set does not miss them.
    - keep_submodule_prefixes: with `submodules`, keep the submodules' prefixes in the keys.
    - strict: set raises on missing or unexpected keys and dtype mismatches (shapes must always match).
    - broadcast_from_rank0: set takes the values from rank 0's full state dict (see Note: who calls what).
    - flatten_optimizer_state_dict: get returns the optimizer state flattened (see Note: state dict keys).
    - dsd_fqn_modifiers: torch's name of the module method that tells its key walk which child a state dict hook
      hid (`gate.weight` saved as `weight`); spmd's walk reads such keys without it, giving torch's keys (the
      model's as its state_dict() names them, the optimizer's as named_parameters() does), so it is accepted and
      needs no method.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


# -- public API -----------------------------------------------------------------------------------------------

def get_model_state_dict(model: nn.Module, *, submodules: set[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, ValueType]:
    """The model's state dict keyed by canonical FQNs (see Note: state dict keys), laid out per `options`.

    `submodules`: only the entries under these modules (keys keep their full FQN unless keep_submodule_prefixes
    is False). Collective with full_state_dict (see Note: who calls what).
    """
    opts = _checked(options)
    _reshard_fsdp(model)
    with torch.no_grad(), _sharded_wrappers(model):
        state = _canonical_model_state(model)
        if submodules:
            state = _under_submodules(model, state, submodules, opts.keep_submodule_prefixes)
        if opts.ignore_frozen_params:
            frozen = {_canonical_fqn(model, name) for name, param in model.named_parameters(remove_duplicate=False)
                      if not param.requires_grad}
            state = {fqn: value for fqn, value in state.items() if fqn not in frozen}
        return _as_requested(state, opts)


def get_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: set[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> OptimizerStateType:
    """The optimizers' state keyed by `model`'s parameter FQNs (see Note: state dict keys), laid out per
    `options`; a fresh optimizer's state is created first (see Note: a fresh optimizer's state).

    `submodules` is accepted for torch's signature and, as in torch, selects model entries only. Collective with
    full_state_dict (see Note: who calls what).
    """
    opts = _checked(options)
    optimizer_list = _as_tuple(optimizers)
    _reshard_fsdp(model)
    with torch.no_grad():
        state = _fqn_optimizer_state(model, optimizer_list)
        if opts.flatten_optimizer_state_dict:
            state = _flattened(state)
        return _as_requested(state, opts)


def get_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules: set[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, ValueType], OptimizerStateType]:
    """(get_model_state_dict, get_optimizer_state_dict) of `model` and `optimizers`, with the same options."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, ValueType], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load a state dict keyed by canonical FQNs into `model`, each value taken to this model's layout
    (see Note: layouts); returns (missing_keys, unexpected_keys) as canonical FQNs.

    With strict (the default), missing or unexpected keys and dtype mismatches raise, naming the keys; a shape
    mismatch always does. Collective (see Note: who calls what).
    """
    opts = _checked(options)
    _reshard_fsdp(model)
    with torch.no_grad(), _sharded_wrappers(model):
        own = model.state_dict()
        own_key = {_canonical_fqn(model, key): key for key in own}
        targets = {fqn: own[key] for fqn, key in own_key.items()}

        def to_layout(path: tuple, value: Any) -> Any:
            return _to_layout(str(path[0]), value, targets.get(str(path[0])), opts.strict)

        if opts.broadcast_from_rank0:
            received = _broadcast_from_rank0(model_state_dict, _transfer_device(targets.values()), to_layout)
        else:
            received = {key: to_layout((key,), value) for key, value in model_state_dict.items()}
        frozen = set()
        if opts.ignore_frozen_params:
            frozen = {_canonical_fqn(model, name) for name, param in model.named_parameters(remove_duplicate=False)
                      if not param.requires_grad}
        missing = [fqn for fqn in targets if fqn not in received and fqn not in frozen]
        unexpected = [key for key in received if key not in targets]
        if opts.strict and (missing or unexpected):
            raise RuntimeError(f"set_model_state_dict({type(model).__name__}): "
                               f"{_key_problems(missing, unexpected)}; pass StateDictOptions(strict=False) to load "
                               f"the keys that match")
        assign = any(isinstance(value, Tensor) and value.is_meta for value in targets.values())
        model.load_state_dict({own_key[fqn]: value for fqn, value in received.items() if fqn in own_key},
                              strict=False, assign=assign)
    return _IncompatibleKeys(missing, unexpected)


def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: OptimizerStateType, *,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state dict (nested or flattened) into `optimizers` of `model`, each value
    taken to the layout of the state it replaces (see Note: layouts and Note: a fresh optimizer's state).

    With strict (the default), a parameter whose state is missing (or lacks an entry this optimizer keeps) or a
    key naming no parameter of these optimizers raises. Collective (see Note: who calls what).
    """
    opts = _checked(options)
    optimizer_list = _as_tuple(optimizers)
    _reshard_fsdp(model)
    with torch.no_grad():
        params = _optimizer_params(model, optimizer_list)
        optim_state_dict = _keyed_by_fqn(optim_state_dict, optimizer_list, params)
        current = _Leaves.of(_fqn_optimizer_state(model, optimizer_list), params)

        def to_layout(path: tuple, value: Any) -> Any:
            leaf = _Leaves.state_leaf(path, params)
            if leaf is None:
                return value
            fqn, names = leaf
            target = current.state.get(fqn, {}).get(names)
            param = params[fqn]
            if not isinstance(target, Tensor) and isinstance(value, Tensor) and value.shape == param.shape \
                    and value.dtype == param.dtype:
                target = param            # no state of that name yet: a tensor like the parameter takes its layout
            return _to_layout(_state_key(fqn, names), value, target, opts.strict)

        if opts.broadcast_from_rank0:
            received = _broadcast_from_rank0(optim_state_dict, _transfer_device(params.values()), to_layout)
            given = _Leaves.of(received, params)
        else:
            given = _Leaves.of(optim_state_dict, params)
            given.state = {fqn: {names: to_layout((_STATE, fqn, *names), value) for names, value in entries.items()}
                           for fqn, entries in given.state.items()}
        missing = _missing_state(current, given)
        if opts.strict and (missing or given.unexpected):
            raise RuntimeError(f"set_optimizer_state_dict: {_key_problems(missing, given.unexpected)}; pass "
                               f"StateDictOptions(strict=False) to load the parameters that match")
        for optimizer in optimizer_list:
            optimizer.load_state_dict(_positional_state(optimizer, model, given, current))


def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, ValueType],
                   optim_state_dict: OptimizerStateType,
                   options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """set_optimizer_state_dict, then set_model_state_dict (torch's order); returns the model's missing and
    unexpected keys."""
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return set_model_state_dict(model, model_state_dict, options=options)


# -- options and model keys -----------------------------------------------------------------------------------

def _checked(options: StateDictOptions | None) -> StateDictOptions:
    opts = options if options is not None else StateDictOptions()
    if not isinstance(opts, StateDictOptions):
        raise TypeError(f"state_dict: options must be a StateDictOptions, got {type(opts).__name__}")
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise ValueError("state_dict: broadcast_from_rank0=True needs full_state_dict=True (rank 0 holds a full "
                         "state dict)")
    return opts


def _as_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


def _reshard_fsdp(model: nn.Module) -> None:
    """Make every fully_shard module hold its sharded parameters (the ones the optimizer steps and the state
    dict holds), as after a training step."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def _sharded_wrappers(model: nn.Module) -> Iterator[None]:
    """FullyShardedDataParallel wrappers (FSDP1's API) give and take DTensors inside the block, as fully_shard
    modules do (their own default is full tensors)."""
    if not FullyShardedDataParallel.fsdp_modules(model):
        yield
        return
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        yield


_ACTIVATION_WRAPPED = "_checkpoint_wrapped_module"   # the child of an activation-checkpoint wrapper (spmd's or torch's)


def _wrapper_child(module: nn.Module) -> str | None:
    """The child name a wrapper module adds to its wrapped module's keys (DDP's `module`, torch.compile's
    `_orig_mod`, an activation-checkpoint wrapper's `_checkpoint_wrapped_module`), or None."""
    if isinstance(module, DistributedDataParallel):
        return "module"
    if isinstance(module, FullyShardedDataParallel):
        return WRAPPED
    if _ACTIVATION_WRAPPED in module._modules:
        return _ACTIVATION_WRAPPED
    dynamo = sys.modules.get("torch._dynamo.eval_frame")     # loaded whenever a module was compiled
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        return "_orig_mod"
    return None


def _canonical_fqn(model: nn.Module, name: str) -> str:
    """`name` (a key of model.state_dict() or named_parameters(), or a module path) without the wrapper
    modules' components (see Note: state dict keys)."""
    kept = []
    module: nn.Module | None = model
    for part in name.split("."):
        while isinstance(module, FullyShardedDataParallel) and part != WRAPPED:
            module = module.module     # its own names already leave it out
        if module is not None and part == _wrapper_child(module):
            module = module._modules[part]
            continue
        kept.append(part)
        module = module._modules.get(part) if module is not None else None
    return ".".join(kept)


def _canonical_model_state(model: nn.Module) -> dict[str, Any]:
    state = {}
    for key, value in model.state_dict().items():
        fqn = _canonical_fqn(model, key)
        if fqn in state:
            raise RuntimeError(f"get_model_state_dict: keys {key!r} and another both name {fqn!r} once wrappers are "
                               f"dropped")
        state[fqn] = value
    return state


def _under_submodules(model: nn.Module, state: dict[str, Any], submodules: set[nn.Module],
                      keep_prefixes: bool) -> dict[str, Any]:
    prefixes = [_canonical_fqn(model, name) + "." for name, module in model.named_modules()
                if module in submodules]
    selected = {}
    for fqn, value in state.items():
        for prefix in prefixes:
            if fqn.startswith(prefix):
                selected[fqn if keep_prefixes else fqn[len(prefix):]] = value
    return selected


def _keyed_by_fqn(optim_state_dict: OptimizerStateType, optimizers: tuple[torch.optim.Optimizer, ...],
                  params: dict[str, nn.Parameter]) -> OptimizerStateType:
    """An optimizer's own state_dict() (state keyed by its parameters' positions, groups listing positions), which
    torch's set_optimizer_state_dict also takes (torchtune resumes so), in the FQN-keyed form; any other as it is."""
    state, groups = optim_state_dict.get(_STATE, {}), optim_state_dict.get(_GROUPS, [])
    positions = [*state, *(position for group in groups for position in group.get(_PARAMS, []))]
    if not positions or not all(isinstance(position, int) for position in positions):
        return optim_state_dict
    if len(optimizers) != 1:
        raise ValueError(f"set_optimizer_state_dict: an optimizer's own state_dict() (parameters by position) "
                         f"belongs to one optimizer, but {len(optimizers)} were given; load each optimizer's own, or "
                         f"the FQN-keyed state dict get_optimizer_state_dict gives")
    fqn_of = {id(param): fqn for fqn, param in params.items()}
    order = [fqn_of[id(param)] for group in optimizers[0].param_groups for param in group[_PARAMS]]
    outside = sorted({position for position in positions if not 0 <= position < len(order)})
    if outside:
        raise ValueError(f"set_optimizer_state_dict: the state dict names parameter positions {outside}, but the "
                         f"optimizer holds {len(order)} parameters (0..{len(order) - 1})")
    return {_STATE: {order[position]: entry for position, entry in state.items()},
            _GROUPS: [{**group, _PARAMS: [order[position] for position in group.get(_PARAMS, [])]}
                      for group in groups]}


def _optimizer_params(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> dict[str, nn.Parameter]:
    """Canonical FQN -> parameter, for every parameter the optimizers hold (its first FQN if tied)."""
    fqn_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        fqn_of.setdefault(id(param), _canonical_fqn(model, name))
    params: dict[str, nn.Parameter] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group[_PARAMS]:
                fqn = fqn_of.get(id(param))
                if fqn is None:
                    raise ValueError(f"state_dict: optimizer {index} ({type(optimizer).__name__}) holds a parameter "
                                     f"of shape {tuple(param.shape)} that is not a parameter of "
                                     f"{type(model).__name__}; create the optimizer from this model's parameters "
                                     f"(after fully_shard / parallelize_module)")
                if fqn in params:
                    raise ValueError(f"state_dict: parameter {fqn} is held by two optimizers (or twice by one)")
                params[fqn] = param
    return params


# -- the optimizer state --------------------------------------------------------------------------------------

def _init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state without changing a parameter (see Note: a fresh optimizer's state)."""
    params = [param for group in optimizer.param_groups for param in group[_PARAMS]]
    trainable = [param for param in params if param.requires_grad]
    if optimizer.state or not trainable or any(param.grad is not None for param in params):
        return
    saved = [{key: group[key] for key in _ZEROED_DURING_INIT if key in group} for group in optimizer.param_groups]
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            group[key] = torch.zeros_like(value) if isinstance(value, Tensor) else 0.0
    for param in trainable:
        param.grad = torch.zeros_like(param)
    try:
        optimizer.step()
    finally:
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)
        for param in trainable:
            param.grad = None
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = type(step)(0)


def _fqn_optimizer_state(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> OptimizerStateType:
    """The optimizers' state dicts merged, parameter positions replaced by FQNs (fresh optimizers initialised)."""
    params = _optimizer_params(model, optimizers)
    fqn_of = {id(param): fqn for fqn, param in params.items()}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optimizer in optimizers:
        _init_optim_state(optimizer)
        positional = optimizer.state_dict()
        order = [fqn_of[id(param)] for group in optimizer.param_groups for param in group[_PARAMS]]
        for position, entry in positional[_STATE].items():
            state[order[position]] = entry
        for group in positional[_GROUPS]:
            groups.append({**group, _PARAMS: [order[position] for position in group[_PARAMS]]})
    return {_STATE: state, _GROUPS: groups}


def _flattened(state: OptimizerStateType) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for fqn, entry in state[_STATE].items():
        for names, value in _dict_leaves(entry):
            flat[_state_key(fqn, names)] = value
    for group in state[_GROUPS]:
        for fqn in group[_PARAMS]:
            for key, value in group.items():
                if key != _PARAMS:
                    flat[f"{_GROUPS}.{fqn}.{key}"] = value
    return flat


def _dict_leaves(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _dict_leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _state_key(fqn: str, names: tuple) -> str:
    return ".".join([_STATE, fqn, *map(str, names)])


def _split_flat_key(rest: str, fqns: dict[str, Any]) -> tuple[str, str] | None:
    """(fqn, remainder) of `rest` = "<fqn>.<remainder>" for a known FQN, or None. Parameter FQNs are never
    prefixes of one another (a parameter has no children), so the first match is the only one."""
    parts = rest.split(".")
    for cut in range(1, len(parts)):
        fqn = ".".join(parts[:cut])
        if fqn in fqns:
            return fqn, ".".join(parts[cut:])
    return None


@dataclasses.dataclass
class _Leaves:
    """An FQN-keyed optimizer state dict, nested or flattened, as its entries per parameter: `state[fqn][names]`
    (names: the key path inside the parameter's state) and `groups[fqn][hyperparameter]`; `unexpected` names
    the entries of no parameter in `params`."""

    state: dict[str, dict[tuple, Any]]
    groups: dict[str, dict[str, Any]]
    unexpected: list[str]

    @classmethod
    def of(cls, optim_state_dict: OptimizerStateType, params: dict[str, nn.Parameter]) -> _Leaves:
        leaves = cls({}, {}, [])
        if _STATE in optim_state_dict or _GROUPS in optim_state_dict:
            for fqn, entry in optim_state_dict.get(_STATE, {}).items():
                if fqn not in params:
                    leaves.unexpected.append(f"{_STATE}.{fqn}")
                    continue
                leaves.state[fqn] = dict(_dict_leaves(entry))
            for group in optim_state_dict.get(_GROUPS, []):
                for fqn in group[_PARAMS]:
                    if fqn not in params:
                        leaves.unexpected.append(f"{_GROUPS}.{fqn}")
                        continue
                    leaves.groups[fqn] = {key: value for key, value in group.items() if key != _PARAMS}
            return leaves
        for key, value in optim_state_dict.items():
            section, _, rest = key.partition(".")
            split = _split_flat_key(rest, params) if section in (_STATE, _GROUPS) else None
            if split is None:
                leaves.unexpected.append(key)
            elif section == _STATE:
                leaves.state.setdefault(split[0], {})[tuple(split[1].split("."))] = value
            else:
                leaves.groups.setdefault(split[0], {})[split[1]] = value
        return leaves

    @staticmethod
    def state_leaf(path: tuple, params: dict[str, nn.Parameter]) -> tuple[str, tuple] | None:
        """(fqn, names) of the value at `path` in a nested or flattened optimizer state dict, or None when it
        is no parameter's state."""
        if len(path) >= 3 and path[0] == _STATE and path[1] in params:
            return path[1], tuple(path[2:])
        if len(path) == 1 and isinstance(path[0], str) and path[0].startswith(_STATE + "."):
            split = _split_flat_key(path[0][len(_STATE) + 1:], params)
            if split is not None:
                return split[0], tuple(split[1].split("."))
        return None


def _positional_state(optimizer: torch.optim.Optimizer, model: nn.Module, given: _Leaves,
                      current: _Leaves) -> dict[str, Any]:
    """`optimizer`'s part of `given` as torch's positional state dict. Tensors are copied into the optimizer's
    own state tensors where it has them (cloned otherwise), and each group keeps its own hyperparameters where
    `given` has none."""
    params = _optimizer_params(model, (optimizer,))
    order = list(params)
    state: dict[int, Any] = {}
    for position, fqn in enumerate(order):
        entries = given.state.get(fqn)
        if not entries:
            continue
        mine = current.state.get(fqn, {})
        entry: dict[Any, Any] = {}
        for names, value in entries.items():
            node = entry
            for name in names[:-1]:
                node = node.setdefault(name, {})
            node[names[-1]] = _owned(value, mine.get(names))
        state[position] = entry
    groups = []
    start = 0
    for index, group in enumerate(optimizer.param_groups):
        fqns = order[start:start + len(group[_PARAMS])]
        start += len(fqns)
        hyper = {key: value for key, value in group.items() if key != _PARAMS}
        chosen: dict[str, tuple[str, Any]] = {}
        for fqn in fqns:
            for key, value in given.groups.get(fqn, {}).items():
                if key == "param_names":
                    continue
                if key in chosen and not _same(chosen[key][1], value):
                    raise RuntimeError(f"set_optimizer_state_dict: parameters {chosen[key][0]} and {fqn} share "
                                       f"param group {index} but the state dict gives them different {key!r} "
                                       f"({chosen[key][1]!r} and {value!r})")
                chosen.setdefault(key, (fqn, value))
        hyper.update({key: value for key, (_, value) in chosen.items()})
        groups.append({**hyper, _PARAMS: list(range(start - len(fqns), start))})
    return {_STATE: state, _GROUPS: groups}


def _owned(value: Any, current: Any) -> Any:
    """`value` in a tensor the optimizer owns: copied into `current` when laid out alike, else cloned."""
    if not isinstance(value, Tensor):
        return value
    if value is current:
        return current
    if isinstance(current, Tensor) and type(current) is type(value) and current.shape == value.shape \
            and current.dtype == value.dtype and current.device == value.device \
            and (not isinstance(value, DTensor) or value.placements == current.placements):
        return current.copy_(value)
    return value.clone()


def _missing_state(current: _Leaves, given: _Leaves) -> list[str]:
    """The parameters whose state `given` lacks, or lacks entries of (named in parentheses)."""
    missing = []
    for fqn, entries in current.state.items():
        have = given.state.get(fqn, {})
        lacking = [".".join(map(str, names)) for names in entries if names not in have]
        if lacking:
            missing.append(f"{fqn} ({', '.join(lacking)})" if have else fqn)
    return missing


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


# -- layouts ----------------------------------------------------------------------------------------------------

def _as_requested(tree: Any, opts: StateDictOptions) -> Any:
    """`tree` with full tensors and/or on the CPU as `opts` asks; {} off rank 0 with both, each gathered tensor
    dropped at once there (see Note: layouts)."""
    rank0_only = opts.full_state_dict and opts.cpu_offload and is_initialized() and get_rank() != 0

    def convert(value: Tensor) -> Tensor | None:
        if opts.full_state_dict and isinstance(value, DTensor):
            value = _full(value)
        if rank0_only:
            return None
        return _on_cpu(value) if opts.cpu_offload else value

    if not (opts.full_state_dict or opts.cpu_offload):
        return tree
    converted = _map_tensors(tree, convert)
    return {} if rank0_only else converted


def _map_tensors(tree: Any, fn: Callable[[Tensor], Any]) -> Any:
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: _map_tensors(value, fn) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_tensors(value, fn) for value in tree)
    return tree


def _full(value: DTensor) -> Tensor:
    """The full value (collective over the mesh); a shard held off the mesh's device (FSDP's CPU offload)
    travels through the mesh's device."""
    mesh = value.device_mesh
    local = value.to_local()
    if local.device.type != mesh.device_type:
        value = DTensor.from_local(local.to(mesh.device_type), mesh, value.placements, shape=value.shape,
                                   stride=value.stride())
    return value.full_tensor()


def _on_cpu(value: Tensor) -> Tensor:
    if not isinstance(value, DTensor):
        return value.cpu()
    return DTensor.from_local(value.to_local().cpu(), value.device_mesh, value.placements, shape=value.shape,
                              stride=value.stride())


def _check_value(key: str, value: Any, target: Any, strict: bool) -> None:
    if not isinstance(value, Tensor) or not isinstance(target, Tensor):
        return
    if value.shape != target.shape:
        raise RuntimeError(f"state_dict: {key} has shape {tuple(value.shape)} in the state dict but "
                           f"{tuple(target.shape)} in the model (global shapes; pass a local shard as a DTensor)")
    if strict and value.dtype != target.dtype:
        raise RuntimeError(f"state_dict: {key} has dtype {value.dtype} in the state dict but {target.dtype} in the "
                           f"model; convert it, or pass StateDictOptions(strict=False) to cast on load")
    if isinstance(value, DTensor) and isinstance(target, DTensor) and value.device_mesh != target.device_mesh \
            and not torch.equal(value.device_mesh.mesh, target.device_mesh.mesh):
        raise RuntimeError(f"state_dict: {key} is a DTensor on {value.device_mesh} but the model holds it on "
                           f"{target.device_mesh}; pass its full tensor (full_tensor()) or a DTensor on the "
                           f"model's mesh")


def _to_layout(key: str, value: Any, target: Any, strict: bool) -> Any:
    """`value` laid out as `target`, the tensor it replaces (see Note: layouts)."""
    if not isinstance(value, Tensor) or not isinstance(target, Tensor):
        return value
    _check_value(key, value, target, strict)
    if not isinstance(target, DTensor):
        if isinstance(value, DTensor):
            return _full(value)
        return value.detach().clone() if target.is_meta else value     # to be assigned: the model's own
    mesh, placements = target.device_mesh, target.placements
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:          # the same ranks in the same layout: the local pieces agree
            value = DTensor.from_local(value.to_local(), mesh, value.placements, shape=value.shape,
                                       stride=value.stride())
        return value.redistribute(placements=placements)
    local_device = target.device if not target.is_meta else torch.device(mesh.device_type)
    laid_out = distribute_tensor(value.detach(), mesh, placements, src_data_rank=None)
    local = laid_out.to_local()
    if local.device != local_device:
        laid_out = DTensor.from_local(local.to(local_device), mesh, placements, shape=value.shape,
                                      stride=laid_out.stride())
    return laid_out


def _key_problems(missing: list[str], unexpected: list[str]) -> str:
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    return " and ".join(problems)


# -- broadcast_from_rank0 ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _TensorMeta:
    """A tensor's place in the structure rank 0 broadcasts first (see Note: who calls what)."""

    shape: torch.Size
    dtype: torch.dtype


def _skeleton(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        if isinstance(tree, DTensor):
            raise ValueError("state_dict: broadcast_from_rank0 takes full tensors on rank 0, got a DTensor; pass "
                             "its full_tensor()")
        return _TensorMeta(tree.shape, tree.dtype)
    if isinstance(tree, dict):
        return {key: _skeleton(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_skeleton(value) for value in tree)
    return tree


def _transfer_device(values: Iterable[Any]) -> torch.device:
    """Where broadcast tensors travel: the device of this model's tensors when the default group's transport
    moves it, else the transport's first device."""
    kinds = current_world().default_group.transport.devices
    for value in values:
        if isinstance(value, Tensor):
            device = value.to_local().device if isinstance(value, DTensor) else value.device
            if device.type in kinds:
                return device
    if kinds[0] == "cpu":
        return torch.device("cpu")
    return torch.device(kinds[0], torch.accelerator.current_device_index())


def _broadcast_from_rank0(tree: Any, device: torch.device, convert: Callable[[tuple, Tensor], Any]) -> Any:
    """Rank 0's `tree` on every rank, each tensor replaced by `convert(path, full tensor)` as it arrives.
    Collective over the default group (see Note: who calls what)."""
    is_source = get_rank() == 0
    structure = [_skeleton(tree) if is_source else None]
    broadcast_object_list(structure, src=0)

    def fill(node: Any, source: Any, path: tuple) -> Any:
        if isinstance(node, _TensorMeta):
            buffer = (source.detach().to(device).contiguous() if is_source
                      else torch.empty(node.shape, dtype=node.dtype, device=device))
            broadcast(buffer, src=0)
            return convert(path, buffer)
        if isinstance(node, dict):
            return {key: fill(value, source[key] if is_source else None, (*path, key)) for key, value in node.items()}
        if isinstance(node, list | tuple):
            return type(node)(fill(value, source[index] if is_source else None, (*path, index))
                              for index, value in enumerate(node))
        return node

    return fill(structure[0], tree, ())
