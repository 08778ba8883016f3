"""Alias at torch's module path `checkpoint.default_planner` (in torch's distributed package): the planner
options save and load take."""

from spmd.checkpoint.api import DefaultLoadPlanner, DefaultSavePlanner

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner"]
