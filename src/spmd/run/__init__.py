"""The launcher: `spmdrun` / `python -m spmd.run` (one agent per node), `spawn` for launching from Python, and
torchrun's `main` / `run` / `get_args_parser` / `parse_args` from Python (spmd.run.torchrun).

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
from spmd.run.torchrun import get_args_parser, main, parse_args, run

__all__ = [
    "ChildFailedError", "LaunchConfig", "ProcessException", "ProcessExitedException", "ProcessRaisedException",
    "SpawnContext", "WorkerFailure", "get_args_parser", "main", "parse_args", "run", "spawn",
]
