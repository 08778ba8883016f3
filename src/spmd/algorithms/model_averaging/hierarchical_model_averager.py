"""Hierarchical model averaging (torch's `HierarchicalModelAverager`): small groups average often, larger ones
less often, the whole group least often (e.g. within a host every 2 steps, everywhere every 8).

Layer: algorithms. The subgroups are made once, at construction (collective over the world).
"""

from __future__ import annotations

import warnings

from spmd.algorithms.model_averaging import utils
from spmd.algorithms.model_averaging.averagers import ModelAverager
from spmd.comm.world import AnyGroup, new_subgroups

__all__ = ["HierarchicalModelAverager"]


class HierarchicalModelAverager(ModelAverager):
    """`period_group_size_dict` maps periods (ascending) to group sizes (ascending, the last the whole group's):
    on a step, the largest period that divides it picks the group its averaging runs over."""

    def __init__(self, period_group_size_dict: dict[int, int] | None = None, warmup_steps: int = 0,
                 process_group: AnyGroup | None = None) -> None:
        super().__init__(process_group)
        if not period_group_size_dict:
            raise ValueError("HierarchicalModelAverager: period_group_size_dict must not be empty")
        periods, sizes = list(period_group_size_dict), list(period_group_size_dict.values())
        if periods != sorted(periods) or periods[0] <= 0:
            raise ValueError(f"HierarchicalModelAverager: the periods must be positive and ascending, got {periods}")
        whole = len(self.process_group.ranks)
        if sizes[-1] != whole:
            raise ValueError(f"HierarchicalModelAverager: the last group size ({sizes[-1]}) must be the size of "
                             f"process_group ({whole})")
        if warmup_steps < 0:
            raise ValueError(f"HierarchicalModelAverager: warmup_steps must be >= 0, got {warmup_steps}")
        if periods[-1] == 1:
            warnings.warn("HierarchicalModelAverager whose largest period is 1 all-reduces every parameter every "
                          "step, which costs no less than DDP's gradient all-reduce: use DDP alone", stacklevel=2)
        self._periods = periods
        self.period_process_group_dict = {
            period: self.process_group if size == whole else new_subgroups(size, group=self.process_group)[0]
            for period, size in period_group_size_dict.items()}
        self.warmup_steps = warmup_steps

    def average_parameters(self, params: utils.Params) -> None:
        if self.step >= self.warmup_steps:
            period = next((p for p in reversed(self._periods) if self.step % p == 0), None)
            if period is not None:
                utils.average_parameters_or_parameter_groups(params, self.period_process_group_dict[period])
        self.step += 1
