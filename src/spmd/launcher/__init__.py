"""Alias at torch's module path `launcher` (in torch's distributed package): launching a job from Python
(spmd.launcher.api)."""

from spmd.launcher.api import LaunchConfig, elastic_launch, launch_agent

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]
