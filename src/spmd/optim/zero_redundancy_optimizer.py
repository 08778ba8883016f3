"""ZeroRedundancyOptimizer: any torch optimizer with its state sharded over the ranks (ZeRO stage 1).

Layer: optim. Each parameter is owned by one rank of the group, which alone keeps its optimizer state and updates
it; after the update every owner broadcasts its parameters, so all replicas stay equal (see Note: who owns what).
It composes with DistributedDataParallel (which reduces the gradients of every parameter) as torch's does.

Note: who owns what
Parameters are assigned group by group, largest first, each to the rank owning the fewest elements so far (ties
to the lowest rank): torch's sorted-greedy partition, so both put every parameter on the same rank and their
consolidated state dicts agree. A DTensor parameter (tensor parallel, under DDP) counts, and is broadcast as,
its local shard, which the group's ranks hold replicas of. The owners' updates travel in place, all broadcasts
in flight at once: one per parameter, or with parameters_as_bucket_view=True one per owner, device and dtype,
of the buffer its parameters are views of (benchmarks/zero.py: flattening into a copy instead cost more than the
broadcasts). The state dict uses the indices a plain optimizer over all the parameters would: `state_dict()`
returns it on the rank that `consolidate_state_dict(to)` gathered it to, and `load_state_dict` takes such a
full state on every rank, each keeping its own parameters' part.

With overlap_with_ddp=True the step runs inside DDP's backward instead (Note: ZeRO inside DDP's backward, in
zero_overlap.py): the parameters are owned by DDP bucket, not by the greedy partition, once a hook of
zero_overlap is built over the DDP module, and `step()` does nothing.
"""

from __future__ import annotations

import copy
import enum
import itertools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from spmd.comm.collectives import broadcast
from spmd.comm.group import ProcessGroup
from spmd.comm.join import Join, Joinable, JoinHook
from spmd.comm.objects import recv_object_list, send_object_list
from spmd.comm.world import AnyGroup, resolve_group
from spmd.tensor import DTensor


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """`optimizer_class(params, **defaults)`, its state sharded over `process_group` (default: the world); see
    Note: who owns what. Call `step` on every rank; `state_dict` needs `consolidate_state_dict` first. A
    Joinable: under `Join([ddp, optimizer])` a rank out of inputs keeps stepping (its gradients are the ones the
    DDP hook's shadow reduction left), so every owner's update still reaches every rank."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], optimizer_class: type[Optimizer],
                 process_group: AnyGroup | None = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, **defaults: Any) -> None:
        self.process_group: ProcessGroup = resolve_group(process_group, "ZeroRedundancyOptimizer")
        self.rank, self.world_size = self.process_group.group_rank, self.process_group.size()
        self.global_rank = self.process_group.global_rank
        self.parameters_as_bucket_view = parameters_as_bucket_view and not overlap_with_ddp   # torch ignores it too
        self._overlap = _Overlap.WAITING_FOR_HOOK if overlap_with_ddp else _Overlap.OFF
        self._optimizer_class = optimizer_class
        self._ready = False
        super().__init__(_checked(params), defaults)
        Joinable.__init__(self)
        self._defaults = defaults
        self._owners = self._partition()
        self.optim: Optimizer = self._local_optimizer()
        self._buckets: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}
        self._build_buckets()
        self._consolidated: list[dict[str, Any]] | None = None
        self._ready = True

    # -- the partition ------------------------------------------------------------------------------------------

    def _partition(self) -> dict[Tensor, int]:
        """The owner of every parameter (Note: who owns what)."""
        owned = [0] * self.world_size
        owners: dict[Tensor, int] = {}
        for group in self.param_groups:
            for param in sorted(group["params"], key=lambda p: _local(p).numel(), reverse=True):
                rank = owned.index(min(owned))
                owners[param] = rank
                owned[rank] += _local(param).numel()
        return owners

    def _local_optimizer(self) -> Optimizer:
        """The optimizer of the parameters this rank owns, in the param groups' order and with their settings."""
        return self._optimizer_class([self._local_group(group, index) for index, group in enumerate(self.param_groups)],
                                     **self._defaults)

    def _own_by_buckets(self, buckets: list[list[Tensor]], shard_buckets: bool) -> None:
        """Own the parameters by DDP bucket (overlap_with_ddp; see zero_overlap.py): each bucket to rank
        `index % world_size`, or with `shard_buckets` each bucket cut into runs of parameters of about
        1/world_size of all the elements, each run to the rank owning the fewest elements so far."""
        if self._overlap is _Overlap.OFF:
            raise ValueError(f"ZeroRedundancyOptimizer on rank {self.global_rank}: a hook that steps inside DDP's "
                             f"backward needs the optimizer built with overlap_with_ddp=True")
        if self._overlap is _Overlap.IN_BACKWARD:
            raise RuntimeError(f"ZeroRedundancyOptimizer on rank {self.global_rank}: already stepped by another "
                               f"DDP hook built over it; build one hook per optimizer")
        mine = set(self._owners)
        bucketed = [p for bucket in buckets for p in bucket]
        in_buckets = set(bucketed)
        if in_buckets != mine:
            raise ValueError(f"ZeroRedundancyOptimizer on rank {self.global_rank}: overlap_with_ddp needs the DDP "
                             f"module's parameters exactly: {len(mine - in_buckets)} of the optimizer's parameters "
                             f"are not in its gradient buckets (frozen or ignored by DDP), {len(in_buckets - mine)} "
                             f"of the buckets' are not the optimizer's")
        owners: dict[Tensor, int] = {}
        owned = [0] * self.world_size
        run_size = sum(_local(p).numel() for p in bucketed) / self.world_size
        for index, bucket in enumerate(buckets):
            if not shard_buckets:
                owners.update(dict.fromkeys(bucket, index % self.world_size))
                continue
            for run in _runs(bucket, run_size):
                rank = owned.index(min(owned))
                owners.update(dict.fromkeys(run, rank))
                owned[rank] += sum(_local(p).numel() for p in run)
        self._owners = owners
        self.optim = self._local_optimizer()
        self._overlap = _Overlap.IN_BACKWARD

    def _local_group(self, group: dict[str, Any], index: int) -> dict[str, Any]:
        """This rank's part of param group `index`, with the group's settings."""
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if self._owners[p] == self.rank]}

    def _owned_by(self, rank: int) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if self._owners[p] == rank]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group on every rank (collective in effect: the partition changes everywhere alike)."""
        if self._ready and self._overlap is not _Overlap.OFF:
            raise RuntimeError(f"ZeroRedundancyOptimizer.add_param_group on rank {self.global_rank}: with "
                               f"overlap_with_ddp=True the parameters are the DDP module's, owned by its buckets")
        super().add_param_group(param_group)
        if self._ready:
            self._owners = self._partition()
            for local, group in zip(self.optim.param_groups, self.param_groups, strict=False):
                local["params"] = [p for p in group["params"] if self._owners[p] == self.rank]
            self.optim.add_param_group(self._local_group(self.param_groups[-1], len(self.param_groups) - 1))
            self._build_buckets()

    def _build_buckets(self) -> None:
        """With parameters_as_bucket_view, make each owner's parameters (per device and dtype) views of one flat
        buffer, the one its step broadcasts."""
        if not self.parameters_as_bucket_view:
            return
        self._buckets = {}
        for rank in range(self.world_size):
            for (device, dtype), params in _by_kind(self._owned_by(rank)).items():
                shards = [_local(param) for param in params]
                bucket = torch.empty(sum(shard.numel() for shard in shards), dtype=dtype, device=device)
                offset = 0
                for shard in shards:
                    view = bucket[offset:offset + shard.numel()].view_as(shard)
                    view.copy_(shard.detach())
                    shard.data = view
                    offset += shard.numel()
                self._buckets[rank, device, dtype] = bucket

    # -- the step -----------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Update this rank's parameters, then every owner's go to the others. Collective. With
        overlap_with_ddp=True nothing: DDP's backward stepped already (as torch's, which warns)."""
        if self._overlap is not _Overlap.OFF:
            warnings.warn("ZeroRedundancyOptimizer(overlap_with_ddp=True): step() does nothing, the step runs in "
                          "DDP's backward; leave it out of the training loop", stacklevel=2)
            return None
        Join.notify_join_context(self)
        _copy_settings(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        _copy_settings(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    def _step_on(self, gradients: dict[Tensor, Tensor]) -> None:
        """Step the parameters this rank owns among `gradients` (parameter -> its averaged gradient, a local
        tensor), each taking its gradient for the step and getting its own back after; the other parameters
        this rank owns sit the step out (overlap_with_ddp; zero_overlap.py runs it per bucket or once)."""
        stepping = {p: g for p, g in gradients.items() if self._owners[p] == self.rank}
        if not stepping:
            return
        kept = {p: p.grad for p in stepping}
        groups = [group["params"] for group in self.optim.param_groups]
        try:
            for param, grad in stepping.items():
                param.grad = _shaped_like(param, grad)
            for group, params in zip(self.optim.param_groups, groups, strict=True):
                group["params"] = [p for p in params if p in stepping]
            _copy_settings(self.param_groups, self.optim.param_groups)
            self.optim.step()
        finally:
            for group, params in zip(self.optim.param_groups, groups, strict=True):
                group["params"] = params
            for param, grad in kept.items():
                param.grad = grad
        _copy_settings(self.optim.param_groups, self.param_groups)

    def _sync_params(self) -> None:
        """Every owner's parameters to every rank, all broadcasts in flight at once (Note: who owns what).
        Collective."""
        pending: list[tuple[Any, Tensor, Tensor | None]] = []
        for rank in range(self.world_size):
            src = self.process_group.ranks[rank]
            if self.parameters_as_bucket_view:
                for (device, dtype), _ in _by_kind(self._owned_by(rank)).items():
                    bucket = self._buckets[rank, device, dtype]
                    pending.append((broadcast(bucket, src=src, group=self.process_group, async_op=True), bucket, None))
                continue
            for param in self._owned_by(rank):
                data = _local(param).detach()
                staged = data if data.is_contiguous() else data.contiguous()
                work = broadcast(staged, src=src, group=self.process_group, async_op=True)
                pending.append((work, staged, None if staged is data or rank == self.rank else data))
        for work, staged, target in pending:
            work.wait()
            if target is not None:
                target.copy_(staged)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A joined rank's step: its own parameters' update and the broadcasts every rank's step runs."""
        return _StepWhenJoined(self)

    @property
    def join_device(self) -> torch.device:
        return next(iter(self._owners)).device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    # -- state --------------------------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on group rank `to`, for its `state_dict()`. Collective."""
        self._check_owners_final("consolidate_state_dict")
        if not 0 <= to < self.world_size:
            raise ValueError(f"ZeroRedundancyOptimizer.consolidate_state_dict on rank {self.global_rank}: to={to} is "
                             f"not a rank of the group (0..{self.world_size - 1})")
        _copy_settings(self.param_groups, self.optim.param_groups)
        mine = _to_cpu(self.optim.state_dict())
        if self.rank != to:
            send_object_list([mine], dst=self.process_group.ranks[to], group=self.process_group)
            self._consolidated = None
            return
        states: list[dict[str, Any]] = []
        for rank in range(self.world_size):
            if rank == to:
                states.append(mine)
            else:
                received: list[Any] = [None]
                recv_object_list(received, src=self.process_group.ranks[rank], group=self.process_group)
                states.append(received[0])
        self._consolidated = states

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, indexed as a plain optimizer over all the parameters would index it; only
        on the rank `consolidate_state_dict` gathered it to, as of then."""
        if self._consolidated is None:
            raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict on rank {self.global_rank}: the state has not "
                               f"been consolidated on this rank; call consolidate_state_dict(to={self.rank}) on "
                               f"every rank first")
        index = {p: i for i, p in enumerate(itertools.chain.from_iterable(g["params"] for g in self.param_groups))}
        state: dict[int, Any] = {}
        for rank, local in enumerate(self._consolidated):
            owned = [[p for p in group["params"] if self._owners[p] == rank] for group in self.param_groups]
            for group_params, local_group in zip(owned, local["param_groups"], strict=True):
                for param, local_index in zip(group_params, local_group["params"], strict=True):
                    if local_index in local["state"]:
                        state[index[param]] = local["state"][local_index]
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [index[p] for p in group["params"]]}
                  for group in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer's state (from `state_dict()`, or a plain optimizer's over the same parameters):
        every rank keeps its own parameters' part."""
        self._check_owners_final("load_state_dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(group["params"]) for saved, group in zip(groups, self.param_groups)):
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict on rank {self.global_rank}: the state dict "
                             f"has param groups of {[len(g['params']) for g in groups]} parameters, this optimizer "
                             f"{[len(g['params']) for g in self.param_groups]}")
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        local_index = {p: i for i, p in enumerate(itertools.chain.from_iterable(
            g["params"] for g in self.optim.param_groups))}
        local_state = {local_index[params[i]]: copy.deepcopy(value) for i, value in state_dict["state"].items()
                       if self._owners[params[i]] == self.rank}
        local_groups = [{**{k: v for k, v in group.items() if k != "params"},
                         "params": [local_index[p] for p in local["params"]]}
                        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True)]
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})

    def _check_owners_final(self, method: str) -> None:
        if self._overlap is _Overlap.WAITING_FOR_HOOK:
            raise RuntimeError(f"ZeroRedundancyOptimizer.{method} on rank {self.global_rank}: with "
                               f"overlap_with_ddp=True the parameters' owners are known once the DDP hook is built "
                               f"(hook_with_zero_step or hook_with_zero_step_interleaved); build it first")

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, rank {self.rank} of {self.world_size}, "
                f"owning {sum(p.numel() for p in self._owned_by(self.rank))} of "
                f"{sum(p.numel() for p in self._owners)} elements)")


class _Overlap(enum.Enum):
    """Where the optimizer steps: in step() (OFF), or in DDP's backward once a hook is built (see zero_overlap)."""

    OFF = "step() after backward"
    WAITING_FOR_HOOK = "overlap_with_ddp: no DDP hook built yet"
    IN_BACKWARD = "overlap_with_ddp: stepped in DDP's backward"


class _StepWhenJoined(JoinHook):
    def __init__(self, optimizer: ZeroRedundancyOptimizer) -> None:
        self.optimizer = optimizer

    def main_hook(self) -> None:
        if self.optimizer._overlap is _Overlap.OFF:    # otherwise the DDP hook's shadow iteration steps
            self.optimizer.step()


def _checked(params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[Any]:
    if isinstance(params, Tensor):
        raise TypeError(f"ZeroRedundancyOptimizer: params must be an iterable of tensors or of param group dicts, "
                        f"got a {torch.typename(params)}")
    items = list(params)
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    tensors = [p for item in items for p in (item["params"] if isinstance(item, dict) else [item])]
    kinds = {(torch.typename(p), p.is_sparse) for p in tensors}
    if any(sparse for _, sparse in kinds) or len({name for name, _ in kinds}) > 1:
        raise ValueError(f"ZeroRedundancyOptimizer: the parameters must all be dense and of one type, got "
                         f"{sorted(name for name, _ in kinds)}")
    return items


def _local(param: Tensor) -> Tensor:
    """What this rank holds of `param`: a DTensor's local shard (tensor parallel under DDP: the group's ranks
    hold replicas of it, as DDP averages it), a plain parameter itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _runs(params: list[Tensor], size: float) -> list[list[Tensor]]:
    """`params` cut into consecutive runs, each closed once its elements reach `size` (the last may be smaller)."""
    runs: list[list[Tensor]] = [[]]
    elements = 0
    for param in params:
        if runs[-1] and elements >= size:
            runs.append([])
            elements = 0
        runs[-1].append(param)
        elements += _local(param).numel()
    return runs


def _shaped_like(param: Tensor, grad: Tensor) -> Tensor:
    """`grad` (a local tensor) as `param`'s gradient: a DTensor parameter's is a DTensor of its layout."""
    if isinstance(param, DTensor):
        return DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return grad


def _copy_settings(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Learning rate and the other settings of each param group, from one optimizer's groups to the other's (a
    scheduler changes the outer ones)."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _by_kind(params: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    kinds: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in params:
        kinds.setdefault((param.device, param.dtype), []).append(param)
    return kinds


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
