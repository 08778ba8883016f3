"""fully_shard and FSDPModule: FSDP2's public API, named and behaving as torch 2.13's FSDP2.

Layer: fsdp (may import _core, _autograd, comm, device_mesh, tensor).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch import nn

from spmd.comm.group import ProcessGroup
from spmd.comm.world import current_world, is_initialized, new_group
from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp.comm import AllGather as AllGatherComm
from spmd.fsdp.comm import (
    DefaultAllGather,
    DefaultReduceScatter,
    GroupAllocAllGather,
    GroupAllocReduceScatter,
)
from spmd.fsdp.comm import ReduceScatter as ReduceScatterComm
from spmd.fsdp.extension import has_extension
from spmd.fsdp.mesh_info import ShardPlacementResult
from spmd.fsdp.param import FSDPParam, ShardMesh, Slot
from spmd.fsdp.param_group import FSDPParamGroup, GroupState, PostForwardMesh
from spmd.fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from spmd.fsdp.state import FSDPState, check_materialised, state_of
from spmd.fsdp.wrapper_config import (  # noqa: F401  (torch's fsdp.api: where FSDP1 code imports these from)
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from spmd.tensor import DTensor
from spmd.tensor.placement import Replicate, Shard

ShardPlacementFn = Callable[[nn.Parameter], "Shard | ShardPlacementResult | None"]


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """torch's: the data-parallel dims of a full SPMD mesh, for fully_shard(module, mesh=full_mesh,
    dp_mesh_dims=...) of parameters that are already DTensors on that mesh, Replicate on these dims. `shard`:
    the dim(s) FSDP shards over (several are flattened into one); `replicate`: HSDP's replica dim(s)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None
_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn: ShardPlacementFn | None = None,
                mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
                offload_policy: OffloadPolicy = _NO_OFFLOAD,
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None) -> Any:
    """Shard the parameters of `module` (or of a list of modules, sharded as one group) over `mesh`, in place.

    Apply it bottom-up: to each block, then to the root. Every parameter not already owned by a fully_shard call
    below becomes a Shard(0) DTensor (or the Shard `shard_placement_fn` returns) on the mesh's last dim; a 2-d
    mesh (replicate, shard) is HSDP. A parameter that is already a tensor-parallel DTensor (on `mesh["tp"]` when
    `mesh` is `mesh["dp"]` of one (dp, tp) mesh) is sharded by its TP-local tensor and becomes a DTensor on the
    parent (dp, tp) mesh (see Note: FSDP over tensor parallelism in param.py). The call's parameters form one
    group: all-gathered in one collective before its forward (and again before backward when resharded),
    reduce-scattered in one after backward. The module's class becomes `FSDP<Class>`, a subclass of FSDPModule.
    `reshard_after_forward` None (the default, torch 2.13's) is True, except for the root, which never reshards
    after forward (backward needs its parameters first).
    With `dp_mesh_dims`, `mesh` is the job's whole mesh and the parameters are DTensors on it, Replicate on
    its data-parallel dims (torch 2.13's form): each becomes its tensor-parallel DTensor on the dim left (or a
    plain tensor), then is sharded as above over the data-parallel dims. Collective over the world (mesh groups
    are created).
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
    mesh = mesh if mesh is not None else _default_mesh()
    if dp_mesh_dims is not None:
        if not dp_mesh_dims.shard:
            raise ValueError(f"fully_shard(dp_mesh_dims={dp_mesh_dims}): name the dim(s) FSDP shards over "
                             f"(shard=...); replicating only is spmd._composable.replicate_with_fsdp.replicate")
        mesh = _from_spmd_mesh(modules, mesh, dp_mesh_dims, ignored_params or set())
    shard_mesh = _check_mesh(mesh, modules)
    _check_not_initialised(modules)
    post_forward_mesh = _post_forward_mesh(reshard_after_forward, mesh, modules)
    manage(modules, shard_mesh, reshard_after_forward, post_forward_mesh, shard_placement_fn, mp_policy,
           offload_policy, ignored_params or set(), FSDPModule)
    return list(modules) if isinstance(module, list) else module


def manage(modules: tuple[nn.Module, ...], shard_mesh: ShardMesh, reshard_after_forward: bool | int,
           post_forward_mesh: PostForwardMesh | None, shard_placement_fn: ShardPlacementFn | None,
           mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy, ignored_params: set[nn.Parameter],
           module_class: type[FSDPModule]) -> FSDPState:
    """The steps fully_shard and replicate share, once their mesh is checked: turn the parameters `modules` own
    into FSDPParams over `shard_mesh` (or the meshes shard_placement_fn names), group them, attach the state,
    and make each module's class a subclass of `module_class`."""
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    shard_device = torch.device("cpu") if offload else shard_mesh.device
    pin_memory = offload and offload_policy.pin_memory and torch.accelerator.is_available()
    _move_buffers(modules, shard_mesh.device)
    by_mesh: dict[ShardMesh, list[FSDPParam]] = {shard_mesh: []}
    for param, slots, fqn in _managed_params(modules, ignored_params, shard_mesh.mesh):
        dim, param_mesh = _placement(shard_placement_fn, param, fqn, shard_mesh)
        by_mesh.setdefault(param_mesh, []).append(
            FSDPParam(param, slots, fqn, param_mesh, dim, mp_policy.param_dtype, shard_device, pin_memory))
    name = "/".join(type(m).__name__ for m in modules)
    if post_forward_mesh is not None and len(by_mesh) > 1:
        raise ValueError(f"fully_shard({name}): reshard_after_forward=int reshards to a part of `mesh`, but "
                         f"shard_placement_fn put parameters on other meshes too; pass True or False")
    groups = [_build_group(params, param_mesh, mp_policy, post_forward_mesh if param_mesh is shard_mesh else None,
                           name) for param_mesh, params in by_mesh.items() if params]
    state = FSDPState(modules, groups, mp_policy, reshard_after_forward, name)
    for m in modules:
        _become_module_class(m, module_class)
    return state


fully_shard.state = state_of   # type: ignore[attr-defined]   # torch's `fully_shard.state(module)` (contract's)


class UnshardHandle:
    """An `unshard(async_op=True)` in flight; `wait()` makes the module hold its full parameters."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


class FSDPModule:
    """The methods every fully_shard module gains (its class becomes a subclass `FSDP<Class>`)."""

    def _fsdp_state(self) -> FSDPState:
        state = state_of(self)   # type: ignore[arg-type]
        assert state is not None
        return state

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        found: list[FSDPState] = []
        for sub in self.modules():   # type: ignore[attr-defined]
            state = state_of(sub)
            if state is not None and state not in found:
                found.append(state)
        return found

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (collective); with async_op, return a handle to wait on. Also
        before the first forward (explicit prefetching of the root's parameters)."""
        state = self._fsdp_state()
        check_materialised(state)
        groups = state.groups
        for group in groups:
            group.unshard(async_op=True)
        handle = UnshardHandle(groups)
        if not async_op:
            handle.wait()
            return None
        return handle

    def reshard(self) -> None:
        """Free this module's full parameters; the module holds its shards again."""
        for group in self._fsdp_state().groups:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps accumulating unsharded gradients without a reduce-scatter (gradient
        accumulation); the next backward with True reduces the sum."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.requires_gradient_sync = requires_gradient_sync

    def reduce_accumulated_gradients(self, *, recurse: bool = True) -> None:
        """Reduce-scatter now the unsharded gradients that backwards accumulated (with gradient sync off, or
        without FSDP's backward hooks, as a pipeline's weight half runs), add them into the sharded `.grad`s and
        reshard (when resharding after backward). Collective over the shard group; a group with no gradients
        only reshards."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.reduce_accumulated()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            if not state.is_root:
                state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, parameters stay unsharded after backward (no all-gather in the next micro-batch's forward;
        only valid while no optimizer step changes the shards)."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With False, the end of backward leaves the last reduce-scatters in flight (micro-batching); the sharded
        gradients are complete after a backward with True."""
        self._fsdp_state().is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by `factor` instead of the number of data-parallel ranks."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor}")
        for state in self._fsdp_states(recurse=True):
            for group in state.groups:
                group.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of set_gradient_divide_factor (deprecated there too)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation: with False, each backward still reduce-scatters within the shard group, but
        the sums wait, unreduced across replicas, until a backward with True all-reduces them all at once."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.options.requires_all_reduce = requires_all_reduce

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: torch.Stream | None = None) -> None:
        """Run `hook(output)` on this module's reduced gradient shard (flat), in place: after the replicas'
        all-reduce on an HSDP mesh, else after the reduce-scatter (a user's own cross-replica reduction, as
        torchft's). In float32/bfloat16 the output is already averaged unless sums are forced
        (set_force_sum_reduction_for_comms), as torch shows it; `stream`, not with HSDP, is the stream to run
        it on."""
        group = self._single_group("set_all_reduce_hook")
        if group is None:
            return
        if stream is not None and group.replicate_group is not None:
            raise ValueError(f"set_all_reduce_hook: {self._fsdp_state().name} is sharded over an HSDP mesh, whose "
                             f"hook runs where the replicas' all-reduce does; pass no stream")
        group.options.all_reduce_hook = hook
        group.options.all_reduce_hook_stream = stream

    def _single_group(self, what: str) -> FSDPParamGroup | None:
        """This module's one parameter group (None without parameters); a ValueError when shard_placement_fn put
        its parameters on several meshes, where a per-module setting would be ambiguous (as torch's)."""
        state = self._fsdp_state()
        if len(state.groups) > 1:
            raise ValueError(f"{what}: {state.name} has parameters on {len(state.groups)} meshes (from "
                             f"shard_placement_fn), so which of its groups it applies to is ambiguous")
        return state.groups[0] if state.groups else None

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """With True, gradients are summed by the collectives and divided only after the all-reduce hook (spmd's
        collectives always sum; this decides what the hook sees, as in torch)."""
        for group in self._fsdp_state().groups:
            group.options.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """With True, a group whose parameters got no gradient on this rank (control flow that differs across
        ranks, as in mixture-of-experts) still reduce-scatters (zeros), so every rank runs the same collectives.
        Parameters without a gradient beside others with one always contribute zeros."""
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.options.reduce_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Let up to `max_input_buffers` reduce-scatters (each holding its group's gradient buffer) stay in flight
        before backward waits for the oldest: more overlap of reduction with compute, more memory. Default 1."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be at least 1, got "
                             f"{max_input_buffers}")
        for state in self._fsdp_states(recurse):
            for group in state.groups:
                group.options.in_flight = max_input_buffers

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, backward does not gather this module's parameters again: for parameters backward never
        reads, such as an embedding table's (its gradient needs only the indices). Their gradients are still
        reduced."""
        for group in self._fsdp_state().groups:
            group.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward of this root makes its all-gathers wait for `event` (recorded after the optimizer step)
        instead of for all work queued before it; used once, then dropped."""
        self._fsdp_state().post_optim_event = event

    def reset_iter_state(self) -> None:
        """After an exception cut a forward or backward short: wait for the collectives in flight, reshard every
        module, and forget the failed iteration (its reductions in flight, unreduced gradients, HSDP sums not yet
        all-reduced), so the next iteration runs as normal. Reductions that finished stay in the sharded `.grad`s:
        zero them before the next step. Call it on the root module, on every rank."""
        state = self._fsdp_state()
        if state.root not in (None, state):
            raise RuntimeError(f"reset_iter_state: {state.name} is not the root; call it on the root module "
                               f"{state.root.name if state.root is not None else ''}")
        state.reset_iteration()

    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """Gather this module's parameters through `comm` (spmd.fsdp.comm.AllGather, torch's Comm protocol): its
        `allocate` makes the output buffer and its call issues the collective."""
        group = self._single_group("set_custom_all_gather")
        if group is not None:
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Reduce-scatter this module's gradients through `comm` (spmd.fsdp.comm.ReduceScatter), which spmd calls
        with ReduceOp.SUM (it divides afterwards)."""
        group = self._single_group("set_custom_reduce_scatter")
        if group is not None:
            group.reduce_scatter_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """With True, the all-gather and reduce-scatter buffers of this module's groups come from their process
        groups' allocator: the transport's own where it has one (torch:nccl's registered memory, for NCCL's
        zero-copy paths), else torch's as before (spmd's own transports have none). Not with a custom comm, whose
        buffers are its own (as torch's)."""
        for group in self._fsdp_state().groups:
            comms = (group.all_gather_comm, group.reduce_scatter_comm)
            if any(type(comm) not in _BUILT_IN_COMMS for comm in comms):
                raise ValueError(f"set_allocate_memory_from_process_group_for_comm: {self._fsdp_state().name} has a "
                                 f"custom all-gather or reduce-scatter comm, which allocates its own buffers")
            gather_group, scatter_group = group.shard_group, group.reduce_scatter_group
            group.all_gather_comm = GroupAllocAllGather(gather_group) if enable and gather_group is not None \
                else DefaultAllGather()
            group.reduce_scatter_comm = GroupAllocReduceScatter(scatter_group) \
                if enable and scatter_group is not None else DefaultReduceScatter()

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """torch's NCCL symmetric-memory buffers for the all-gather: not served (spmd's torch:nccl transport does
        not set up symmetric memory); refused, so a script does not believe it runs on them."""
        raise NotImplementedError(f"set_symm_mem_for_comm({backend!r}): spmd does not serve NCCL symmetric memory; "
                                  f"set_allocate_memory_from_process_group_for_comm(True) gives NCCL's registered "
                                  f"buffers over the torch:nccl transport")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run gradient reduce-scatters on a process group of their own over the shard ranks (one per set of
        ranks), so they proceed beside backward's all-gathers instead of queuing behind them on one group; False
        goes back to the shard group. Collective over each shard group's ranks, in the same order."""
        made: dict[tuple[int, ...], ProcessGroup] = {}
        for group in (group for state in self._fsdp_states(recurse) for group in state.groups):
            if not enable or group.shard_group is None:     # a replicate-only group scatters nothing
                group.reduce_scatter_group = group.shard_group
                continue
            ranks = tuple(group.shard_group.ranks)
            if ranks not in made:
                made[ranks] = new_group(list(ranks), use_local_synchronization=True)
            group.reduce_scatter_group = made[ranks]

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In this module's forward, start the all-gathers of `modules` (replacing the implicit next-module one)."""
        self._fsdp_state().forward_prefetch = [_state_for_prefetch(m, "set_modules_to_forward_prefetch")
                                               for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In this module's backward, start the all-gathers of `modules` (replacing the implicit one)."""
        self._fsdp_state().backward_prefetch = [_state_for_prefetch(m, "set_modules_to_backward_prefetch")
                                                for m in modules]

    def _apply(self, fn: Callable, recurse: bool = True) -> Any:
        """nn.Module._apply (to_empty, to, ...), then re-adopt the converted shards as the managed parameters."""
        states = self._fsdp_states(recurse=True)
        for state in states:
            if any(group.state is not GroupState.SHARDED for group in state.groups):
                raise RuntimeError(f"{type(self).__name__}._apply (to/to_empty/...): {state.name} holds its "
                                   f"full parameters; call reshard() first")
        result = super()._apply(fn, recurse)   # type: ignore[misc]
        for state in states:
            for param in state.params:
                param.reset_sharded_param()
        return result


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` (a `generate`, an `encode`: a method run instead of forward) gather the
    parameters before it and reshard them after, as forward does. A no-op for a module fully_shard has not
    wrapped, as in torch, so one script serves both."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state()

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, as_forward)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """torch's: make these FSDP roots (a pipeline rank's stages) share their communication streams. spmd's
    FSDP has no streams of its own (a collective is ordered on the caller's current stream: Note: streams in
    spmd.comm.group), so they share them already; this checks each is an FSDP module."""
    for index, module in enumerate(modules):
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx: modules[{index}] is a {type(module).__name__}, not a module "
                             f"fully_shard wrapped")


def _state_for_prefetch(module: object, method: str) -> FSDPState:
    state = state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"{method}: {type(module).__name__} is not a fully_shard module")
    return state


_BUILT_IN_COMMS = (DefaultAllGather, DefaultReduceScatter, GroupAllocAllGather, GroupAllocReduceScatter)
_MODULE_CLASSES: dict[tuple[type, type], type] = {}


def _become_module_class(module: nn.Module, module_class: type[FSDPModule]) -> None:
    """Make `module` an instance of `<prefix><Class>`, a subclass of `module_class` (FSDPModule: `FSDP`, or
    ReplicateModule: `Replicate`) and of its class; hook its state dict."""
    cls = type(module)
    if not issubclass(cls, FSDPModule):      # FullyShardedDataParallel already is one
        made = _MODULE_CLASSES.get((module_class, cls))
        if made is None:
            prefix = module_class.__name__.removesuffix("Module")
            made = _MODULE_CLASSES[(module_class, cls)] = type(f"{prefix}{cls.__name__}", (module_class, cls), {})
        module.__class__ = made
    module.register_state_dict_pre_hook(_reshard_before_state_dict)
    module.register_load_state_dict_post_hook(_readopt_after_load)


def _reshard_before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    state = state_of(module)
    for group in state.groups if state is not None else []:
        group.reshard()


def _readopt_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    state = state_of(module)
    for param in state.params if state is not None else []:
        param.reset_sharded_param()


# -- the steps of fully_shard --------------------------------------------------------------------------------

def _default_mesh() -> DeviceMesh:
    if not is_initialized():
        raise RuntimeError("fully_shard: no process group; call spmd.init_process_group() first or pass mesh=")
    world = current_world()
    accelerator = torch.accelerator.current_accelerator()
    devices = world.default_group.transport.devices
    device_type = accelerator.type if accelerator is not None and accelerator.type in devices else "cpu"
    return init_device_mesh(device_type, (world.world_size,))


def _from_spmd_mesh(modules: tuple[nn.Module, ...], mesh: DeviceMesh, dims: DataParallelMeshDims,
                    ignored: set[nn.Parameter], caller: str = "fully_shard") -> DeviceMesh:
    """The data-parallel mesh `dims` names in the full `mesh`; the parameters that are DTensors on `mesh` are
    replaced (in every slot: tied ones stay tied) by their DTensor on the one dim left, or by their local
    tensor when no dim is left."""
    where = f"{caller}({', '.join(type(m).__name__ for m in modules)}, dp_mesh_dims={dims})"
    names = mesh.mesh_dim_names or ()

    def named(field: str | tuple[str, ...] | None) -> tuple[str, ...]:
        chosen = (field,) if isinstance(field, str) else tuple(field or ())
        for name in chosen:
            if name not in names:
                raise ValueError(f"{where}: the mesh has no dim {name!r}; its dims are {names}")
        return chosen

    shard, replicate = named(dims.shard), named(dims.replicate)
    if shard and replicate and (len(shard) > 1 or len(replicate) > 1):
        raise ValueError(f"{where}: HSDP takes one replicate dim and one shard dim; flatten several first "
                         f"(mesh[...].flatten(name)) and name the flattened dims")
    rest = [name for name in names if name not in (*shard, *replicate)]
    if len(rest) > 1:
        raise ValueError(f"{where}: the parameters' other dims {rest} are more than one; fully_shard composes "
                         f"with tensor parallelism on one dim")
    dp_dims = [names.index(name) for name in (*replicate, *shard)]
    replaced: dict[int, nn.Parameter] = {}
    for module in modules:
        for prefix, sub in _unowned_modules(module):
            for name, param in list(sub._parameters.items()):
                if not isinstance(param, DTensor) or param in ignored or param.device_mesh != mesh:
                    continue
                if id(param) not in replaced:
                    if any(not isinstance(param.placements[d], Replicate) for d in dp_dims):
                        raise ValueError(f"{where}: parameter {prefix + '.' if prefix else ''}{name} is "
                                         f"{list(param.placements)} on {names}: Replicate on the data-parallel "
                                         f"dims is needed, FSDP shards those")
                    local = param.to_local()
                    if rest:
                        tp = names.index(rest[0])
                        local = DTensor.from_local(local, mesh[rest[0]], [param.placements[tp]], run_check=False,
                                                   shape=param.shape, stride=param.stride())
                    replaced[id(param)] = nn.Parameter(local.detach(), requires_grad=param.requires_grad)
                setattr(sub, name, replaced[id(param)])
    for several in (shard, replicate if not shard else ()):
        if len(several) > 1:
            return mesh[several].flatten("_".join(several))
    return mesh[(*replicate, *shard)]


def _check_mesh(mesh: DeviceMesh, modules: tuple[nn.Module, ...]) -> ShardMesh:
    names = ", ".join(type(m).__name__ for m in modules)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard({names}): mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard({names}): mesh must be 1-d (shard) or 2-d (replicate, shard), got a "
                         f"{mesh.ndim}-d mesh {tuple(mesh.shape)}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard({names}) on rank {mesh.get_rank()}: this rank is not in the mesh "
                         f"{mesh.mesh.tolist()}; every rank that runs the model must be in its mesh")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type == mesh.device_type:      # the rank's current GPU
        device = torch.device(mesh.device_type, torch.accelerator.current_device_index())
    else:                                   # cpu, meta: devices without an index
        device = torch.device(mesh.device_type)
    return ShardMesh(mesh, device)


def _check_not_initialised(modules: tuple[nn.Module, ...]) -> None:
    for module in modules:
        if state_of(module) is not None:
            raise ValueError(f"fully_shard: {type(module).__name__} is already sharded; call fully_shard once per "
                             f"module")
        for sub in module.modules():
            state = state_of(sub)
            if state is not None and state.root is not None:
                raise RuntimeError(f"fully_shard({type(module).__name__}): {state.name} already ran forward "
                                   f"before this module was sharded; shard every module (bottom-up, root last) "
                                   f"before the first forward")


def _post_forward_mesh(reshard_after_forward: bool | int, mesh: DeviceMesh,
                       modules: tuple[nn.Module, ...]) -> PostForwardMesh | None:
    if isinstance(reshard_after_forward, bool):
        return None
    names = ", ".join(type(m).__name__ for m in modules)
    size = mesh.size(mesh.ndim - 1)
    if not isinstance(reshard_after_forward, int) or not 1 < reshard_after_forward < size \
            or size % reshard_after_forward:
        raise ValueError(f"fully_shard({names}): reshard_after_forward must be True, False or a divisor of the "
                         f"shard mesh dim's size {size} other than 1 and {size} (the group to reshard to, e.g. "
                         f"the ranks of one host), got {reshard_after_forward!r}")
    small = reshard_after_forward
    ranks = mesh.mesh.reshape(*mesh.mesh.shape[:-1], size // small, small)
    post_forward = DeviceMesh(mesh.device_type, ranks)
    return PostForwardMesh(post_forward.get_group(post_forward.ndim - 1), small,
                           mesh.get_local_rank(mesh.ndim - 1) % small)


def _move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    for module in modules:
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.device.type != "meta" and buffer.device != device:
                    sub._buffers[name] = buffer.to(device)


def _managed_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter],
                    mesh: DeviceMesh) -> list[tuple[nn.Parameter, list[Slot], str]]:
    """The parameters this call shards: those of `modules` not under a fully_shard submodule and not ignored,
    each once with every (module, name) it is registered under (tied weights) and its qualified name."""
    ignored_ids = {id(p) for p in ignored}
    found: dict[int, tuple[nn.Parameter, list[Slot], str]] = {}
    for module in modules:
        for prefix, sub in _unowned_modules(module):
            for name, param in sub._parameters.items():
                if param is None or id(param) in ignored_ids:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if isinstance(param, DTensor):
                    if _owned_by_fsdp(param, module):
                        continue          # a tied parameter a fully_shard submodule already manages
                    _check_tensor_parallel(param, fqn, mesh, type(module).__name__)
                if id(param) in found:
                    found[id(param)][1].append(Slot(sub, name))
                else:
                    found[id(param)] = (param, [Slot(sub, name)], fqn)
    return list(found.values())


def _check_tensor_parallel(param: DTensor, fqn: str, mesh: DeviceMesh, name: str) -> None:
    """A DTensor parameter must be tensor-parallel: Shard/Replicate on a mesh sliced, like `mesh`, from one root
    mesh, on dims after `mesh`'s (see Note: FSDP over tensor parallelism in param.py)."""
    tp_mesh = param.device_mesh
    where = f"fully_shard({name}): parameter {fqn} is a DTensor ({list(param.placements)} on {tp_mesh})"
    if tp_mesh.device_type != mesh.device_type:
        raise ValueError(f"{where}, on device type {tp_mesh.device_type!r}, but the FSDP mesh is on "
                         f"{mesh.device_type!r}")
    if not all(type(p) in (Shard, Replicate) for p in param.placements):
        raise ValueError(f"{where}; a tensor-parallel parameter must be Shard or Replicate on its mesh")
    try:
        DeviceMesh._concatenate([mesh, tp_mesh])
    except ValueError as error:
        raise ValueError(f"{where}; fully_shard shards it over {mesh} as well, which must be another slice of "
                         f"the same mesh, on dims before the tensor-parallel one (e.g. mesh['dp'] and "
                         f"mesh['tp'] of init_device_mesh(..., mesh_dim_names=('dp', 'tp'))): {error}") from None


def _unowned_modules(module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """`module` and its submodules, skipping the subtrees of fully_shard submodules (their own groups)."""
    stack = [("", module)]
    seen: set[int] = set()
    while stack:
        prefix, sub = stack.pop(0)
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        yield prefix, sub
        for name, child in sub._modules.items():
            if child is not None and state_of(child) is None:
                stack.append((f"{prefix}.{name}" if prefix else name, child))


def _owned_by_fsdp(param: DTensor, module: nn.Module) -> bool:
    for sub in module.modules():
        state = state_of(sub)
        if state is not None and any(p.sharded_param is param for p in state.params):
            return True
    return False


def _placement(shard_placement_fn: ShardPlacementFn | None, param: nn.Parameter, fqn: str,
               default: ShardMesh) -> tuple[int, ShardMesh]:
    """The dim to shard `param` on and the mesh to shard it over: what shard_placement_fn returns (None:
    Shard(0); a Shard; or a ShardPlacementResult naming another mesh), on `default` unless it names one."""
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    shard_mesh = default
    if isinstance(result, ShardPlacementResult):
        shard_mesh = _check_mesh(result.mesh_info.mesh, ())
        result = result.placement
    placement = Shard(0) if result is None else result
    if not isinstance(placement, Shard):
        raise ValueError(f"fully_shard: shard_placement_fn returned {placement!r} for {fqn}; return a Shard(dim), "
                         f"a ShardPlacementResult or None (Shard(0))")
    if param.ndim == 0:
        raise ValueError(f"fully_shard: {fqn} is a scalar (0-d) parameter, which can't be sharded (nor can torch's "
                         f"fully_shard); make it a 1-d tensor of one element")
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(f"fully_shard: cannot shard {fqn} of shape {tuple(param.shape)} on dim {placement.dim}")
    return dim, shard_mesh


def _build_group(params: list[FSDPParam], shard_mesh: ShardMesh, mp_policy: MixedPrecisionPolicy,
                 post_forward_mesh: PostForwardMesh | None, name: str) -> FSDPParamGroup:
    """The group of one fully_shard call. Its trainable parameters must share a dtype (their gradients are
    reduced in one collective, as torch's); its dtype is theirs, or the one holding most elements. Frozen
    parameters of other dtypes are gathered in the same collective, each into a buffer of its own."""
    gathered = [param for param in params if not has_extension(param.local_shard, param.fqn)]
    trainable = {param.unsharded_dtype for param in gathered if param.requires_grad}
    if len(trainable) > 1:
        listed = ", ".join(f"{p.fqn}: {p.unsharded_dtype}" for p in gathered if p.requires_grad)
        raise ValueError(f"fully_shard({name}): the trainable parameters of one group must share a dtype, their "
                         f"gradients being reduced together ({listed}); set MixedPrecisionPolicy(param_dtype=...) "
                         f"or shard them separately (frozen parameters may differ)")
    sizes: collections.Counter[torch.dtype] = collections.Counter()
    for param in gathered:
        sizes[param.unsharded_dtype] += param.shape.numel()
    gather_dtype = (trainable.pop() if trainable else sizes.most_common(1)[0][0] if sizes
                    else params[0].unsharded_dtype)
    if post_forward_mesh is not None and any(param.unsharded_dtype != gather_dtype for param in gathered):
        others = ", ".join(f"{p.fqn}: {p.unsharded_dtype}" for p in gathered if p.unsharded_dtype != gather_dtype)
        raise ValueError(f"fully_shard({name}): reshard_after_forward=int keeps one {gather_dtype} copy sharded "
                         f"over the smaller group, but {others} differ; pass True or False, or shard them "
                         f"separately")
    reduce_dtype = mp_policy.reduce_dtype or gather_dtype
    return FSDPParamGroup(params, shard_mesh, gather_dtype, reduce_dtype, mp_policy, post_forward_mesh, name)
