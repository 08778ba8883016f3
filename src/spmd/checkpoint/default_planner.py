"""torch's `torch.distributed.checkpoint.default_planner` path: the planner options save and load take."""

from spmd.checkpoint.api import DefaultLoadPlanner, DefaultSavePlanner

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner"]
