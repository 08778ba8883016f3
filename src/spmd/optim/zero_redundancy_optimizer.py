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
"""

from __future__ import annotations

import copy
import itertools
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
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True (the step run inside DDP's "
                             "communication hook) is not supported; call step() after backward, as by default")
        self.process_group: ProcessGroup = resolve_group(process_group, "ZeroRedundancyOptimizer")
        self.rank, self.world_size = self.process_group.group_rank, self.process_group.size()
        self.global_rank = self.process_group.global_rank
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optimizer_class = optimizer_class
        self._ready = False
        super().__init__(_checked(params), defaults)
        Joinable.__init__(self)
        self._owners = self._partition()
        local_groups = [self._local_group(group, index) for index, group in enumerate(self.param_groups)]
        self.optim: Optimizer = optimizer_class(local_groups, **defaults)
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

    def _local_group(self, group: dict[str, Any], index: int) -> dict[str, Any]:
        """This rank's part of param group `index`, with the group's settings."""
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if self._owners[p] == self.rank]}

    def _owned_by(self, rank: int) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if self._owners[p] == rank]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group on every rank (collective in effect: the partition changes everywhere alike)."""
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
        """Update this rank's parameters, then every owner's go to the others. Collective."""
        Join.notify_join_context(self)
        _copy_settings(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        _copy_settings(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

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

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, rank {self.rank} of {self.world_size}, "
                f"owning {sum(p.numel() for p in self._owned_by(self.rank))} of "
                f"{sum(p.numel() for p in self._owners)} elements)")


class _StepWhenJoined(JoinHook):
    def __init__(self, optimizer: ZeroRedundancyOptimizer) -> None:
        self.optimizer = optimizer

    def main_hook(self) -> None:
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
