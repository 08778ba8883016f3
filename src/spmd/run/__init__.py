"""The launcher: `spmdrun` / `python -m spmd.run` (one agent per node) and `spawn` for launching from Python.

Layer: run (L5). Imports only spmd._core and spmd.comm (stores), never tensor or parallel code, so the launcher
starts fast. See spmd.run.agent for the agent, spmd.run.rendezvous for how nodes agree on rounds.
"""

from spmd.run.config import LaunchConfig
from spmd.run.failure import (
    ChildFailedError,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    WorkerFailure,
)
from spmd.run.spawn import SpawnContext, spawn

__all__ = [
    "ChildFailedError", "LaunchConfig", "ProcessException", "ProcessExitedException", "ProcessRaisedException",
    "SpawnContext", "WorkerFailure", "spawn",
]
