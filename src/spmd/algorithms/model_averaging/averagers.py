"""Model averagers (torch's `model_averaging.averagers`): when, over which group, the replicas are averaged.

Layer: algorithms. Call `average_parameters(params)` after every `optimizer.step()`; it counts the steps and
averages on the ones its schedule names (collective over its group on those steps only, identically on every
rank since all count alike).
"""

from __future__ import annotations

import abc
import warnings

from spmd.algorithms.model_averaging import utils
from spmd.comm.world import AnyGroup, default_group

__all__ = ["ModelAverager", "PeriodicModelAverager"]


class ModelAverager(abc.ABC):
    """A schedule of parameter averaging over `process_group` (default: the world); `step` counts the calls."""

    def __init__(self, process_group: AnyGroup | None = None) -> None:
        self.process_group = process_group if process_group is not None else default_group()
        self.step = 0

    @abc.abstractmethod
    def average_parameters(self, params: utils.Params) -> None:
        """Average `params` (parameters or param groups) if this step is one to average on; count the step."""


class PeriodicModelAverager(ModelAverager):
    """Average every `period` steps once `warmup_steps` steps have run (the first at step `warmup_steps`)."""

    def __init__(self, period: int, warmup_steps: int = 0, process_group: AnyGroup | None = None) -> None:
        super().__init__(process_group)
        if warmup_steps < 0:
            raise ValueError(f"PeriodicModelAverager: warmup_steps must be >= 0, got {warmup_steps}")
        if period < 1:
            raise ValueError(f"PeriodicModelAverager: period must be >= 1, got {period}")
        if period == 1:
            warnings.warn("PeriodicModelAverager with period=1 all-reduces every parameter every step, which costs "
                          "no less than DDP's gradient all-reduce: use DDP alone", stacklevel=2)
        self.warmup_steps = warmup_steps
        self.period = period

    def average_parameters(self, params: utils.Params) -> None:
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            utils.average_parameters_or_parameter_groups(params, self.process_group)
        self.step += 1
