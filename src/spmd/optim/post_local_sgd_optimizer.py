"""Post-local SGD's optimizer (torch's `PostLocalSGDOptimizer`): any optimizer's step followed by a model
averager's (spmd.algorithms.model_averaging), so the replicas that trained apart are averaged on schedule.

Layer: optim. The averager's step count travels in the state dict ("step"), so a resumed run averages on the
same steps.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """`optim` (whose param groups and state it shares), then `averager.average_parameters(param_groups)` after
    every step. Collective on the steps the averager averages on."""

    def __init__(self, optim: torch.optim.Optimizer, averager: Any) -> None:
        if not callable(getattr(averager, "average_parameters", None)):
            raise TypeError(f"PostLocalSGDOptimizer: averager must be a model averager (with average_parameters), "
                            f"got {type(averager).__name__}")
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager

    @property
    def state(self) -> Any:   # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:   # type: ignore[override]
        return self.optim.defaults

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> dict[str, Any]:
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn("PostLocalSGDOptimizer.load_state_dict: the state dict has no averager step count; "
                          "the averager starts again from step 0", stacklevel=2)
            self.averager.step = 0

    def step(self) -> None:   # type: ignore[override]
        self.optim.step()
        self.averager.average_parameters(params=self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
