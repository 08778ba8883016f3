"""Alias at torch's module path (`checkpoint.stateful`) of the Stateful protocol. Layer: checkpoint."""

from spmd.checkpoint.api import Stateful

__all__ = ["Stateful"]
