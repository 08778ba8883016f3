"""FullyShardedDataParallel: torch's FSDP1 wrapper API, built on fully_shard, so FSDP1 scripts (the DCP and FSDP
tutorials still write `FSDP(model, auto_wrap_policy=...)`) port by their import.

Layer: fsdp (may import _core, _autograd, comm, device_mesh, tensor).

Each wrapper is one fully_shard unit: `FSDP(module)` holds `module` as `_fsdp_wrapped_module` and shards the
parameters not inside a nested wrapper (the auto-wrap policy's units are wrapped first, bottom-up), tensor-parallel
ones (DTensors on mesh["tp"], the wrapper given mesh["dp"]) as fully_shard shards them. What FSDP1
users see is kept: the wrapper's `state_dict()`, `named_parameters()` and `named_buffers()` use the plain
module's names (no `_fsdp_wrapped_module.`), `state_dict()` is full by default and follows `state_dict_type`,
attributes fall through to the wrapped module, and `no_sync`, `summon_full_params`, `clip_grad_norm_` and the
optimizer state-dict functions behave as torch's. The differences: parameters are always the original
parameters, as Shard(0) DTensors (torch's `use_orig_params=True` without its 1-d views; no FlatParameter), so
`SHARDED_STATE_DICT` holds DTensors and `LOCAL_STATE_DICT` each parameter's local shard rather than a flat
buffer; `limit_all_gathers` is always in effect, and FSDP1's comm hooks are not served.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from spmd.comm.collectives import broadcast
from spmd.comm.objects import all_gather_object, broadcast_object_list
from spmd.comm.world import current_world, get_process_group_ranks, get_rank
from spmd.device_mesh import DeviceMesh
from spmd.fsdp.api import FSDPModule, _unowned_modules, fully_shard
from spmd.fsdp.param import FSDPParam
from spmd.fsdp.param_group import GroupState
from spmd.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from spmd.fsdp.state import FSDPState, _cast_floating, state_of
from spmd.fsdp.wrap import Policy, PolicyFn, wrap_modules
from spmd.fsdp.wrapper_config import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from spmd.tensor import DTensor, distribute_tensor

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]

WRAPPED = "_fsdp_wrapped_module"
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_STATE_DICT_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def _strip(name: str) -> str:
    """`name` without the wrappers' `_fsdp_wrapped_module` components."""
    return ".".join(part for part in name.split(".") if part != WRAPPED)


class FullyShardedDataParallel(FSDPModule, nn.Module):
    """Shard `module`'s parameters over the ranks (torch's FSDP1 wrapper; see the module docstring).

    Collective over the world (or `process_group`'s ranks): every rank wraps the same model the same way. The
    arguments are torch's; `use_orig_params` and `limit_all_gathers` are accepted and always in effect.
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 sharding_strategy: ShardingStrategy | None = None, cpu_offload: CPUOffload | None = None,
                 auto_wrap_policy: PolicyFn | Policy | None = None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules: Iterable[nn.Module] | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, device_id: int | torch.device | None = None,
                 sync_module_states: bool = False, forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, ignored_states: Iterable[Any] | None = None,
                 device_mesh: DeviceMesh | None = None, *, _mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        _check_arguments(module, strategy, process_group, device_mesh, mixed_precision, ignored_modules,
                         ignored_states)
        ignored_mods, ignored_params = _ignored(module, ignored_modules, ignored_states)
        device = _compute_device(module, device_id)
        nested = _mesh is not None
        mesh = _mesh if nested else _mesh_for(strategy, process_group, device_mesh, device.type)
        if auto_wrap_policy is not None:
            unit = functools.partial(FullyShardedDataParallel, sharding_strategy=strategy, cpu_offload=cpu_offload,
                                     backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                                     ignored_states=ignored_params, param_init_fn=param_init_fn,
                                     device_id=device_id, sync_module_states=sync_module_states,
                                     forward_prefetch=forward_prefetch, process_group=process_group,
                                     _mesh=mesh)
            if mixed_precision is not None and mixed_precision._module_classes_to_ignore:
                _wrap_in_full_precision(module, mixed_precision, unit, ignored_mods)
            wrapped = {sub for wrapper in module.modules() if isinstance(wrapper, FullyShardedDataParallel)
                       for sub in wrapper.modules()}
            wrap_modules(module, auto_wrap_policy, unit, ignored_mods | wrapped)
        self._fsdp_wrapped_module = module
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        self._state_dict_settings = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                                      FullOptimStateDictConfig())
        own = [sub for _, sub in _unowned_modules(module)]
        _materialize(own, device, param_init_fn)
        for sub in own:
            sub._apply(lambda t: t.to(device), recurse=False)
        if sync_module_states:
            _sync_from_first_rank(own, mesh)
        self._buffer_dtypes = _cast_buffers(self, mixed_precision)
        fully_shard(self, mesh=mesh, reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD,
                                                                          ShardingStrategy.HYBRID_SHARD),
                    mp_policy=_mp_policy(mixed_precision, nested),
                    offload_policy=CPUOffloadPolicy(pin_memory=False) if cpu_offload and cpu_offload.offload_params
                    else OffloadPolicy(),
                    ignored_params=ignored_params)
        if backward_prefetch is None:
            self.set_modules_to_backward_prefetch([])
        if not forward_prefetch:
            self.set_modules_to_forward_prefetch([])
        self._param_keys = _param_keys(self)
        self._register_state_dict_hook(_post_state_dict)
        self._register_load_state_dict_pre_hook(_pre_load_state_dict, with_module=True)

    # -- the wrapped module -------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks are the wrapped module's (`model.config` keeps working)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)   # type: ignore[operator]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameter names (no `_fsdp_wrapped_module.`), each a sharded DTensor."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield _strip(name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield _strip(name), buffer

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """nn.Module.apply with this wrapper's full parameters in place (so `fn` can initialise weights); what
        `fn` writes goes back to the shards."""
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        return self

    # -- training -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block backward accumulates gradients without reducing them; the first backward after it
        reduces the sum (gradient accumulation). Call it on the root wrapper."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Reduce gradients with `hook` instead of FSDP's collectives, in this wrapper and every one inside it:
        `hook(state, grad)` for NO_SHARD (averages the flat gradient in place), `hook(state, grad, output)` for
        the sharded strategies (writes this rank's shard of the average; the flat gradient is rank-major: rank r's
        shard is its r-th equal part). The hook divides (the default hooks in algorithms._comm_hooks do); once
        per wrapper, not with the hybrid strategies (as torch)."""
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        for wrapper in wrappers:
            if wrapper.sharding_strategy in _HYBRID:
                raise NotImplementedError(f"FullyShardedDataParallel.register_comm_hook: communication hooks are "
                                          f"not served with {wrapper.sharding_strategy.name} (nor in torch)")
            group = state_of(wrapper).group
            if group is not None and group.custom_reduce is not None:
                raise RuntimeError("FullyShardedDataParallel.register_comm_hook: a communication hook is already "
                                   "registered; register one, once, on the root wrapper")
        for wrapper in wrappers:
            group = state_of(wrapper).group
            if group is None:
                continue
            if wrapper.sharding_strategy is ShardingStrategy.NO_SHARD:
                group.custom_reduce = functools.partial(_replicated_hook, state, hook)
            else:
                group.custom_reduce = functools.partial(hook, state)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Scale the gradients so their total `norm_type` norm over all ranks is at most `max_norm`; returns that
        norm before clipping (the same on every rank). Collective; call it on the root wrapper."""
        params = [p for p in self.parameters() if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        sharded = [p for p in params if isinstance(p.grad, DTensor)]
        local = [p for p in params if not isinstance(p.grad, DTensor)]
        norms = []
        if sharded:
            norm = torch.nn.utils.get_total_norm([p.grad for p in sharded], norm_type)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if local:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in local], norm_type))
        total = torch.nn.utils.get_total_norm(norms, norm_type) if len(norms) > 1 else norms[0]
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for param in params:
            param.grad.mul_(coefficient)
        return total

    # -- gathering ----------------------------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> Iterator[None]:
        """Inside the block the modules hold their full parameters (in their own dtype), gathered from every
        rank; with `writeback`, what the block writes to them goes back to each rank's shard. With rank0_only
        only global rank 0 holds them (every rank gathers; writeback must then be False). Collective; not
        inside forward or backward."""
        if rank0_only and writeback:
            raise ValueError("summon_full_params: rank0_only=True needs writeback=False (the other ranks have "
                             "nothing to write back)")
        states = _states_under(module, recurse)
        summoned: list[tuple[FSDPParam, Tensor]] = []
        keep = not rank0_only or get_rank() == 0
        for state in states:
            group = state.group
            if group is None:
                continue
            if group.state is not GroupState.SHARDED:
                group.reshard()
            for param in group.params:
                full = _full_param(param, offload_to_cpu, with_grads)
                if keep:
                    for slot in param.slots:
                        slot.set(full)
                    summoned.append((param, full))
        try:
            yield
        finally:
            for param, full in summoned:
                if writeback:
                    with torch.no_grad():
                        param.local_shard.copy_(_shard_of_whole(param, full.detach()))
                for slot in param.slots:
                    slot.set(param.sharded_param)

    # -- state dicts --------------------------------------------------------------------------------------

    def check_is_root(self) -> bool:
        """Whether this wrapper is the root of its tree (the outermost: its forward runs first). Before any forward
        it initialises FSDP with this wrapper as the root, as torch's does. Collective then (the model check)."""
        state = state_of(self)
        assert state is not None
        if state.root is None:
            state._lazy_init()
        return state.is_root

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The wrappers in `module`'s tree (module included), parents first; with root_only, the outermost."""
        found = [sub for sub in module.modules() if isinstance(sub, FullyShardedDataParallel)]
        if not root_only:
            return found
        nested = {id(inner) for outer in found for inner in outer.module.modules()
                  if isinstance(inner, FullyShardedDataParallel)}
        return [sub for sub in found if id(sub) not in nested]

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config: StateDictConfig | None = None,
                            optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
        """Make every wrapper in `module`'s tree return `state_dict_type` state dicts; returns the previous
        settings (of the first wrapper)."""
        wrappers = FullyShardedDataParallel.fsdp_modules(module)
        if not wrappers:
            raise ValueError(f"set_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel")
        config_type, optim_config_type = _STATE_DICT_CONFIGS[state_dict_type]
        config = state_dict_config if state_dict_config is not None else config_type()
        optim_config = optim_state_dict_config if optim_state_dict_config is not None else optim_config_type()
        for value, expected in ((config, config_type), (optim_config, optim_config_type)):
            if type(value) is not expected:
                raise ValueError(f"set_state_dict_type: {state_dict_type.name} takes a {expected.__name__}, got "
                                 f"{type(value).__name__}")
        previous = wrappers[0]._state_dict_settings
        for wrapper in wrappers:
            wrapper._state_dict_settings = StateDictSettings(state_dict_type, config, optim_config)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the wrappers in `module`'s tree (they must agree)."""
        wrappers = FullyShardedDataParallel.fsdp_modules(module)
        if not wrappers:
            raise ValueError(f"get_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel")
        settings = wrappers[0]._state_dict_settings
        if any(w._state_dict_settings != settings for w in wrappers[1:]):
            raise RuntimeError("get_state_dict_type: the wrappers in this model have different state-dict "
                               "settings; set them with FullyShardedDataParallel.set_state_dict_type(model, ...)")
        return settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> Iterator[None]:
        """Inside the block, `set_state_dict_type`'s settings; the previous ones are restored after it."""
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(module, previous.state_dict_type,
                                                         previous.state_dict_config,
                                                         previous.optim_state_dict_config)

    # -- optimizer state dicts ----------------------------------------------------------------------------

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None, group: Any = None) -> dict[str, Any]:
        """`optim`'s state keyed by parameter names, laid out as the model's state-dict type says (full tensors,
        DTensors or local shards). Collective for full state dicts."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        config = settings.optim_state_dict_config
        return _named_optim_state(model, optim, optim_state_dict, settings.state_dict_type,
                                  config.offload_to_cpu, getattr(config, "rank0_only", False))

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: Any = None) -> dict[str, Any]:
        """`optim`'s state keyed by parameter names, as full tensors (on rank 0 only, with rank0_only)."""
        return _named_optim_state(model, optim, None, StateDictType.FULL_STATE_DICT, False, rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: Any = None) -> dict[str, Any]:
        """`optim`'s state keyed by parameter names, as DTensors."""
        return _named_optim_state(model, optim, None, StateDictType.SHARDED_STATE_DICT, False, False)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: Any = None) -> dict[str, Any]:
        """A name-keyed optimizer state dict (full, sharded or local) as `optim.load_state_dict` takes it, each
        tensor in its parameter's layout; with load_directly, loaded into `optim` as well."""
        loadable = _positional_optim_state(model, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(loadable)
        return loadable

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                    optim_input: Any = None, optim: torch.optim.Optimizer | None = None) -> dict:
        """torch's older name for optim_state_dict_to_load of a full state dict."""
        return _positional_optim_state(model, _required(optim, "shard_full_optim_state_dict"), full_optim_state_dict)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any], model: nn.Module,
                                         optim: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's older name for optim_state_dict_to_load of a sharded state dict."""
        return _positional_optim_state(model, optim, sharded_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                      optim_input: Any = None, optim: torch.optim.Optimizer | None = None,
                                      group: Any = None) -> dict[str, Any]:
        """optim_state_dict_to_load of the full state dict only rank 0 passes (the others pass None)."""
        holder = [full_optim_state_dict if get_rank() == 0 else None]
        broadcast_object_list(holder, src=0)
        return _positional_optim_state(model, _required(optim, "scatter_full_optim_state_dict"), holder[0])

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: OptimStateKeyType,
                               model: nn.Module, optim_input: Any = None,
                               optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """The optimizer state dict keyed by parameter names (PARAM_NAME) or positions (PARAM_ID)."""
        names = _positions_to_names(model, _required(optim, "rekey_optim_state_dict"))
        by_name = optim_state_key_type is OptimStateKeyType.PARAM_NAME
        key = (lambda k: names.get(k, k)) if by_name else \
            (lambda k: {n: i for i, n in names.items()}.get(k, k))
        return {"state": {key(k): v for k, v in optim_state_dict["state"].items()},
                "param_groups": [{**g, "params": [key(k) for k in g["params"]]}
                                 for g in optim_state_dict["param_groups"]]}


# -- construction --------------------------------------------------------------------------------------------

def _replicated_hook(state: object, hook: Callable[..., None], grad: Tensor, output: Tensor) -> None:
    """NO_SHARD's hook in a group's reduction: a shard group of one rank, so the output is the whole gradient."""
    hook(state, grad)
    output.copy_(grad)


def _check_arguments(module: nn.Module, strategy: ShardingStrategy, process_group: Any,
                     device_mesh: DeviceMesh | None, mixed_precision: MixedPrecision | None,
                     ignored_modules: Any, ignored_states: Any) -> None:
    name = f"FullyShardedDataParallel({type(module).__name__})"
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError(f"{name}: the module is already wrapped")
    if process_group is not None and device_mesh is not None:
        raise ValueError(f"{name}: pass process_group or device_mesh, not both")
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(f"{name}: pass ignored_modules or ignored_states, not both")
    if device_mesh is not None:
        want = 2 if strategy in _HYBRID else 1
        if device_mesh.ndim != want:
            raise ValueError(f"{name}: {strategy.name} takes a {want}-d device_mesh, got {device_mesh.ndim}-d "
                             f"{device_mesh}" + (" (replicate, shard)" if want == 2 else ""))
    if isinstance(process_group, tuple) and strategy not in _HYBRID:
        raise ValueError(f"{name}: a (intra-node, inter-node) process_group pair is for HYBRID_SHARD, not "
                         f"{strategy.name}")
    if mixed_precision is not None and mixed_precision.keep_low_precision_grads:
        raise ValueError(f"{name}: keep_low_precision_grads=True is not served: spmd reduces in reduce_dtype and "
                         f"keeps gradients in the parameters' dtype (as FSDP2 does)")


def _ignored(module: nn.Module, ignored_modules: Iterable[nn.Module] | None,
             ignored_states: Iterable[Any] | None) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules and the parameters neither sharded nor reduced (theirs, or those listed)."""
    items = list(ignored_modules or ignored_states or ())
    modules = {m for m in items if isinstance(m, nn.Module)}
    params = {p for m in modules for p in m.parameters()} | {p for p in items if isinstance(p, nn.Parameter)}
    if len(modules) + len({p for p in items if isinstance(p, nn.Parameter)}) != len(items):
        raise TypeError("FullyShardedDataParallel: ignored_states must be modules or parameters")
    return modules, params


def _compute_device(module: nn.Module, device_id: int | torch.device | None) -> torch.device:
    if isinstance(device_id, int):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise ValueError(f"FullyShardedDataParallel: device_id={device_id} names an accelerator, but this "
                             f"machine has none; leave device_id unset (or pass torch.device('cpu'))")
        return torch.device(accelerator.type, device_id)
    if device_id is not None:
        return torch.device(device_id)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            return tensor.device if not isinstance(tensor, DTensor) else tensor._local_tensor.device
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type in current_world().default_group.transport.devices:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _mesh_for(strategy: ShardingStrategy, process_group: Any, device_mesh: DeviceMesh | None,
              device_type: str) -> DeviceMesh:
    """The mesh fully_shard gets: the group's ranks (1-d), (group, 1) for NO_SHARD, (replicate, shard) for the
    hybrid strategies (shard within a node: LOCAL_WORLD_SIZE ranks, as launchers set it)."""
    world = current_world()
    if device_mesh is not None and strategy is not ShardingStrategy.NO_SHARD:
        return device_mesh
    if strategy is ShardingStrategy.NO_SHARD:
        ranks = (device_mesh.mesh.reshape(-1).tolist() if device_mesh is not None
                 else get_process_group_ranks(process_group) if process_group is not None
                 else list(range(world.world_size)))
        return _grid(device_type, [[rank] for rank in ranks], ("replicate", "shard"))
    if strategy in _HYBRID:
        if process_group is None:
            node = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
            if world.world_size % node:
                raise ValueError(f"FullyShardedDataParallel: {strategy.name} shards within a node of "
                                 f"LOCAL_WORLD_SIZE={node} ranks, which does not divide the world of "
                                 f"{world.world_size}; pass device_mesh=init_device_mesh(..., (replicas, shards))")
            rows = [list(range(start, start + node)) for start in range(0, world.world_size, node)]
            return _grid(device_type, rows, ("replicate", "shard"))
        if not isinstance(process_group, tuple) or len(process_group) != 2:
            raise ValueError(f"FullyShardedDataParallel: {strategy.name} takes process_group=(intra_node_group, "
                             f"inter_node_group) or a 2-d device_mesh, got {process_group!r}")
        return _grid(device_type, _hybrid_rows(*process_group), ("replicate", "shard"))
    if process_group is None:
        return DeviceMesh(device_type, list(range(world.world_size)))
    return DeviceMesh(device_type, get_process_group_ranks(process_group), _groups=[process_group])


def _grid(device_type: str, rows: list[list[int]], names: tuple[str, str]) -> DeviceMesh:
    """The 2-d mesh of this rank's `rows` (each a shard group; rank i of each row forms a replica group), as a
    slice of the world's mesh of every rank's rows. Collective over the world."""
    world = current_world()
    everyone: list[Any] = [None] * world.world_size
    all_gather_object(everyone, rows)
    layouts = list(dict.fromkeys(tuple(map(tuple, r)) for r in everyone))
    if len(layouts) == 1:
        return DeviceMesh(device_type, rows, mesh_dim_names=names)
    sizes = {(len(layout), len(layout[0])) for layout in layouts}
    if len(sizes) != 1:
        raise ValueError(f"FullyShardedDataParallel: the ranks' groups have different shapes {sorted(sizes)}")
    root = DeviceMesh(device_type, [list(map(list, layout)) for layout in layouts],
                      mesh_dim_names=("_fsdp_groups", *names))
    return root[names]


def _hybrid_rows(intra: Any, inter: Any) -> list[list[int]]:
    """The (replicate, shard) grid of the world that the ranks' (intra-node, inter-node) groups form."""
    world = current_world()
    pairs: list[Any] = [None] * world.world_size
    all_gather_object(pairs, (get_process_group_ranks(intra), get_process_group_ranks(inter)))
    shard_of = {rank: tuple(pair[0]) for rank, pair in enumerate(pairs)}
    replicas = get_process_group_ranks(inter)
    rows = [list(shard_of[rank]) for rank in replicas]
    position = rows[0].index(replicas[0]) if replicas[0] in rows[0] else -1
    if any(len(row) != len(rows[0]) for row in rows) or any(row[position] != rank for row, rank in
                                                             zip(rows, replicas, strict=True)):
        raise ValueError(f"FullyShardedDataParallel: the intra-node groups {rows} and the inter-node group "
                         f"{replicas} do not form a (replicate, shard) grid")
    return rows


def _wrap_in_full_precision(module: nn.Module, mixed_precision: MixedPrecision, unit: Callable[..., nn.Module],
                            ignored: set[nn.Module]) -> None:
    """Wrap each module of `_module_classes_to_ignore` (BatchNorm) as its own unit without mixed precision,
    its floating inputs cast to its parameters' dtype and its outputs back to the input dtype (as torch)."""
    classes = tuple(mixed_precision._module_classes_to_ignore)

    def full_precision(sub: nn.Module) -> nn.Module | None:
        if not isinstance(sub, classes) or sub in ignored or isinstance(sub, FullyShardedDataParallel):
            return None
        dtype = next((p.dtype for p in sub.parameters()), torch.get_default_dtype())
        inputs: dict[str, torch.dtype] = {}

        def cast_inputs(_: nn.Module, args: tuple) -> tuple:
            floating = [t for t in tree_leaves(args)
                        if isinstance(t, Tensor) and t.is_floating_point()]
            if floating:
                inputs["dtype"] = floating[0].dtype
            return _cast_floating(args, dtype)

        def cast_outputs(_: nn.Module, args: tuple, output: Any) -> Any:
            return _cast_floating(output, inputs["dtype"]) if "dtype" in inputs else output

        sub.register_forward_pre_hook(cast_inputs)
        sub.register_forward_hook(cast_outputs)
        return unit(sub, mixed_precision=None)

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            wrapped = full_precision(child)
            if wrapped is not None:
                setattr(parent, name, wrapped)


def _materialize(modules: list[nn.Module], device: torch.device,
                 param_init_fn: Callable[[nn.Module], None] | None) -> None:
    """Give meta-device modules real tensors on `device`: `param_init_fn(module)` when given, else to_empty and
    the module's own reset_parameters()."""
    for module in modules:
        tensors = [*module._parameters.values(), *module._buffers.values()]
        if not any(t is not None and t.device.type == "meta" for t in tensors):
            continue
        if param_init_fn is not None:
            param_init_fn(module)
            continue
        module.to_empty(device=device, recurse=False)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _sync_from_first_rank(modules: list[nn.Module], mesh: DeviceMesh) -> None:
    """Every rank's parameters and buffers become those of the mesh's first rank (sync_module_states), broadcast
    along each mesh dim in turn. Of a tensor-parallel DTensor, this tp rank's shard (the same one over the mesh)."""
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    with torch.no_grad():
        for module in modules:
            for tensor in [*module._parameters.values(), *module._buffers.values()]:
                if tensor is None:
                    continue
                local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor.data
                for group in groups:
                    broadcast(local, src=min(get_process_group_ranks(group)), group=group)


def _cast_buffers(wrapper: nn.Module, mixed_precision: MixedPrecision | None) -> dict[str, torch.dtype]:
    """Cast the wrapper's own buffers to buffer_dtype; their original dtypes by state-dict key (relative)."""
    if mixed_precision is None or mixed_precision.buffer_dtype is None:
        return {}
    original = {}
    for path, sub in _unowned_modules(wrapper):
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                original[_strip(f"{path}.{name}" if path else name)] = buffer.dtype
                sub._buffers[name] = buffer.to(mixed_precision.buffer_dtype)
    return original


def _mp_policy(mixed_precision: MixedPrecision | None, nested: bool) -> MixedPrecisionPolicy:
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    cast = mixed_precision.cast_forward_inputs or (not nested and mixed_precision.cast_root_forward_inputs)
    return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype,
                                cast_forward_inputs=cast and mixed_precision.param_dtype is not None)


def _param_keys(wrapper: nn.Module) -> dict[str, FSDPParam]:
    """The wrapper's sharded parameters by state-dict key relative to it (every tied name)."""
    state = state_of(wrapper)
    if state is None or state.group is None:
        return {}
    paths = {id(sub): path for path, sub in nn.Module.named_modules(wrapper, remove_duplicate=False)}
    return {_strip(f"{paths[id(slot.module)]}.{slot.name}".lstrip(".")): param
            for param in state.group.params for slot in param.slots}


def _states_under(module: nn.Module, recurse: bool) -> list[FSDPState]:
    if not recurse:
        state = state_of(module)
        return [state] if state is not None else []
    found: list[FSDPState] = []
    for sub in module.modules():
        state = state_of(sub)
        if state is not None and state not in found:
            found.append(state)
    return found


def _full_param(param: FSDPParam, offload_to_cpu: bool, with_grads: bool) -> nn.Parameter:
    """The full value of `param` (all-gathered; collective over its mesh), as a parameter, with its full
    gradient when asked."""
    sharded = param.sharded_param
    full = sharded.detach().full_tensor()
    full = full.cpu() if offload_to_cpu else full
    summoned = nn.Parameter(full, requires_grad=sharded.requires_grad)
    if with_grads and sharded.grad is not None:
        grad = sharded.grad.full_tensor() if isinstance(sharded.grad, DTensor) else sharded.grad
        summoned.grad = grad.cpu() if offload_to_cpu else grad
    return summoned


def _required(optim: torch.optim.Optimizer | None, name: str) -> torch.optim.Optimizer:
    if optim is None:
        raise ValueError(f"FullyShardedDataParallel.{name}: pass optim= (spmd has no optim_input form)")
    return optim


# -- state-dict hooks ----------------------------------------------------------------------------------------

def _post_state_dict(wrapper: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str,
                     local_metadata: Any) -> None:
    """The wrapper's keys without `_fsdp_wrapped_module.`, buffers in their own dtype, values as the state-dict
    type says. Wrappers nest: the inner ones' hooks have already renamed and converted their keys."""
    own = f"{prefix}{WRAPPED}."
    settings = wrapper._state_dict_settings
    config = settings.state_dict_config
    keep = not (isinstance(config, FullStateDictConfig) and config.rank0_only and get_rank() != 0)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict.pop(key)
        name = key[len(own):] if key.startswith(own) else key[len(prefix):]
        if name in wrapper._buffer_dtypes:
            value = value.to(wrapper._buffer_dtypes[name])
        if isinstance(value, DTensor):
            if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
                value = value.full_tensor()
            elif settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
                value = value.to_local()
        if config.offload_to_cpu and not isinstance(value, DTensor):
            value = value.cpu()
        if keep:
            state_dict[prefix + name] = value


def _pre_load_state_dict(wrapper: FullyShardedDataParallel, state_dict: dict[str, Any], prefix: str,
                         *args: Any) -> None:
    """Put the wrapper's `_fsdp_wrapped_module.` back in its keys, and a full (or local) value of a sharded
    parameter into that parameter's layout: each rank keeps its piece."""
    kind = wrapper._state_dict_settings.state_dict_type
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(f"{prefix}{WRAPPED}.")]:
        name = key[len(prefix):]
        value = state_dict.pop(key)
        param = wrapper._param_keys.get(name)
        if param is not None and isinstance(value, Tensor) and not isinstance(value, DTensor):
            value = _to_layout(value, param, kind, key)
        state_dict[f"{prefix}{WRAPPED}.{name}"] = value


def _to_layout(value: Tensor, param: FSDPParam, kind: StateDictType, key: str) -> DTensor:
    local = param.local_shard
    if kind is StateDictType.LOCAL_STATE_DICT:
        if value.shape != local.shape:
            raise RuntimeError(f"load_state_dict: {key} is this rank's shard of shape {tuple(local.shape)} in a "
                               f"LOCAL_STATE_DICT, got shape {tuple(value.shape)}")
        return DTensor(value.to(local.device), param.spec)
    if value.shape != param.shape:
        raise RuntimeError(f"load_state_dict: {key} has shape {tuple(value.shape)}; the parameter's full shape is "
                           f"{tuple(param.shape)}")
    return DTensor(_shard_of_whole(param, value.to(local.device)), param.spec)


def _shard_of_whole(param: FSDPParam, whole: Tensor) -> Tensor:
    """This rank's shard of `param` cut from its whole value: over tensor parallelism, of this tp rank's piece."""
    if param.tp_spec is not None:
        whole = distribute_tensor(whole, param.tp_spec.mesh, param.tp_spec.placements, src_data_rank=None).to_local()
    return param._local_shard_of(whole)


# -- optimizer state dicts -----------------------------------------------------------------------------------

def _positions_to_names(model: nn.Module, optim: torch.optim.Optimizer) -> dict[int, str]:
    """The parameter name of each position in `optim.state_dict()` (its param_groups' order)."""
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    positions: dict[int, str] = {}
    for param in (p for group in optim.param_groups for p in group["params"]):
        if id(param) not in names:
            raise ValueError(f"optimizer state dict: the optimizer holds a parameter of shape "
                             f"{tuple(param.shape)} that {type(model).__name__} does not")
        positions[len(positions)] = _strip(names[id(param)])
    return positions


def _named_optim_state(model: nn.Module, optim: torch.optim.Optimizer, positional: dict[str, Any] | None,
                       kind: StateDictType, offload_to_cpu: bool, rank0_only: bool) -> dict[str, Any]:
    """optim.state_dict() keyed by parameter names, its DTensors full (FULL), as they are (SHARDED) or local
    (LOCAL). Collective over the parameters' meshes for FULL."""
    positional = positional if positional is not None else optim.state_dict()
    names = _positions_to_names(model, optim)

    def laid_out(value: Any) -> Any:
        if isinstance(value, DTensor):
            if kind is StateDictType.FULL_STATE_DICT:
                value = value.full_tensor()
            elif kind is StateDictType.LOCAL_STATE_DICT:
                value = value.to_local()
        elif isinstance(value, Tensor) and kind is StateDictType.FULL_STATE_DICT:
            value = value.clone()        # a full state dict is a copy throughout (Adam's step counts too)
        if offload_to_cpu and isinstance(value, Tensor) and not isinstance(value, DTensor):
            value = value.cpu()
        return value

    state = {names[position]: {k: laid_out(v) for k, v in values.items()}
             for position, values in positional["state"].items()}
    if rank0_only and get_rank() != 0:
        return {}
    return {"state": state, "param_groups": [{**group, "params": [names[p] for p in group["params"]]}
                                             for group in positional["param_groups"]]}


def _positional_optim_state(model: nn.Module, optim: torch.optim.Optimizer,
                            named: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict as `optim.load_state_dict` takes it: keyed by `optim`'s positions, each
    tensor the size of its parameter in that parameter's layout (a full one split, a local one wrapped)."""
    names = _positions_to_names(model, optim)
    positions = {name: position for position, name in names.items()}
    params = [p for group in optim.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, values in named["state"].items():
        if name not in positions:
            raise KeyError(f"optim_state_dict_to_load: the state dict has state for {name}, which the optimizer "
                           f"does not hold")
        param = params[positions[name]]
        state[positions[name]] = {k: _optim_value_layout(v, param, f"{name}.{k}") for k, v in values.items()}
    saved_groups = named["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"optim_state_dict_to_load: the state dict has {len(saved_groups)} param groups, the "
                         f"optimizer {len(optim.param_groups)}")
    groups = []
    position_of = {id(param): position for position, param in enumerate(params)}
    for saved, live in zip(saved_groups, optim.param_groups, strict=True):
        ids = [positions[name] for name in saved["params"]]
        if sorted(ids) != sorted(position_of[id(p)] for p in live["params"]):
            raise ValueError(f"optim_state_dict_to_load: a param group of the state dict holds {saved['params']}, "
                             f"the optimizer's another set")
        groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": groups}


def _optim_value_layout(value: Any, param: Tensor, key: str) -> Any:
    if not isinstance(param, DTensor) or not isinstance(value, Tensor) or isinstance(value, DTensor) \
            or value.ndim == 0:
        return value
    local = param._local_tensor
    if value.shape == param.shape:
        return distribute_tensor(value.to(local.device), param.device_mesh, param.placements, src_data_rank=None)
    if value.shape == local.shape:
        return DTensor(value.to(local.device), param._spec)
    raise RuntimeError(f"optim_state_dict_to_load: {key} has shape {tuple(value.shape)}, neither the parameter's "
                       f"full shape {tuple(param.shape)} nor its local shard's {tuple(local.shape)}")

