"""Join: training loops whose ranks have different numbers of inputs, without hangs (torch's generic protocol).

Layer: comm. A `Joinable` (DistributedDataParallel, ZeroRedundancyOptimizer, or the user's own) calls
`Join.notify_join_context(self)` before its per-iteration collectives; a rank that runs out of inputs leaves the
`with Join([...]):` block and there shadows those collectives through each joinable's `JoinHook` until every rank
has left (see Note: the join protocol).

Note: the join protocol
Only the first joinable of a Join communicates for the context: each iteration, every rank still training calls
notify_join_context, an all_reduce of 1 (with throw_on_early_termination, then an all_reduce of 0 that a joined
rank answers with 1, so every rank raises). A rank that has left repeats: all_reduce 0, matching the notify; if
the sum is 0, every rank has left; else each hook's `main_hook` runs the collectives one iteration of its
joinable would (in the joinables' order, as the training ranks run them). When all have left, each hook's
`post_hook(is_last_joiner)` runs: True on the ranks that left last, which ran every iteration. The joinables'
configs are set when the block is entered and cleared when it ends, so their collectives outside it are plain.
"""

from __future__ import annotations

import abc
import dataclasses
from types import TracebackType
from typing import Any

import torch

from spmd.comm.collectives import all_reduce
from spmd.comm.work import Work
from spmd.comm.world import AnyGroup, resolve_group


class JoinHook:
    """What a joined rank does for one joinable: `main_hook` shadows one iteration's collectives, `post_hook`
    runs once every rank has joined. Both do nothing unless overridden."""

    def main_hook(self) -> None:
        """Run the collectives one iteration of the joinable runs on the ranks still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """After every rank has joined; `is_last_joiner` is True on the ranks that ran every iteration."""


@dataclasses.dataclass(frozen=True)
class _JoinConfig:
    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False


class Joinable(abc.ABC):
    """Something with per-iteration collectives that a Join can shadow: give it `join_hook`, `join_device` and
    `join_process_group`, call `Joinable.__init__`, and call `Join.notify_join_context(self)` each iteration."""

    def __init__(self) -> None:
        self._join_config = _JoinConfig()

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs for this joinable; `kwargs` are the Join's."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        """Where the join protocol's counters live (the joinable's device)."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> AnyGroup:
        """The group the joinable communicates over."""


class Join:
    """`with Join([model, optimizer, ...]):` around a training loop whose ranks may run out of inputs at
    different iterations; see Note: the join protocol. `kwargs` go to every joinable's `join_hook`."""

    def __init__(self, joinables: list[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs: Any) -> None:
        if not joinables:
            raise ValueError("Join: give at least one joinable")
        missing = [type(j).__name__ for j in joinables if not hasattr(j, "_join_config")]
        if missing:
            raise TypeError(f"Join: {missing} did not call Joinable.__init__ in their constructor")
        self._joinables = list(joinables)
        self._hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        groups = {id(resolve_group(j.join_process_group, "Join")): j for j in self._joinables}
        if len(groups) > 1:
            raise ValueError(f"Join: the joinables communicate over different groups "
                             f"({[type(j).__name__ for j in groups.values()]}); give one Join the joinables of one "
                             f"group")
        self._group = resolve_group(self._joinables[0].join_process_group, "Join")
        self._device = self._joinables[0].join_device

    def __enter__(self) -> Join:
        inside = [type(j).__name__ for j in self._joinables if j._join_config.enable]
        if inside:
            raise RuntimeError(f"Join on rank {self._group.global_rank}: {inside} already inside a join context")
        if self._enable:
            for index, joinable in enumerate(self._joinables):
                joinable._join_config = _JoinConfig(True, self._throw, is_first_joinable=index == 0)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if self._enable and kind is None:      # a failing rank's error propagates: its groups abort
                self._keep_pace()
        finally:
            for joinable in self._joinables:
                joinable._join_config = _JoinConfig()

    def _keep_pace(self) -> None:
        """Shadow the training ranks until every rank has joined, then run the post hooks. Collective."""
        is_last_joiner = True
        while True:
            training = torch.zeros(1, device=self._device)
            all_reduce(training, group=self._group)
            if int(training.item()) == 0:
                break
            if self._throw:
                all_reduce(torch.ones(1, device=self._device), group=self._group)
                raise RuntimeError(f"Join on rank {self._group.global_rank}: this rank ran out of inputs before "
                                   f"{int(training.item())} other(s), and throw_on_early_termination=True")
            for hook in self._hooks:
                hook.main_hook()
            is_last_joiner = False
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Tell the Join around `joinable` this rank is still training (see Note: the join protocol); returns the
        async all_reduce whose result counts the ranks still training, or None where this joinable is not the
        first of an entered Join. Collective inside a Join."""
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise TypeError(f"Join.notify_join_context: {type(joinable).__name__} did not call Joinable.__init__")
        if not (config.enable and config.is_first_joinable):
            return None
        group = resolve_group(joinable.join_process_group, "Join")
        work = all_reduce(torch.ones(1, device=joinable.join_device), group=group, async_op=True)
        if config.throw_on_early_termination:
            joined = torch.zeros(1, device=joinable.join_device)
            all_reduce(joined, group=group)
            if joined.item():
                raise RuntimeError(f"Join on rank {group.global_rank}: {int(joined.item())} rank(s) ran out of "
                                   f"inputs before the others, and throw_on_early_termination=True")
        return work
