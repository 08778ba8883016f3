"""`record`, the decorator torchrun scripts put on their entry point, and ChildFailedError, at torch's path.

Layer: run. Under spmdrun a worker's uncaught exception is already written to the error file the agent reads
(spmd.run.bootstrap), so `record` has nothing to add and returns the function unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from spmd.run.failure import ChildFailedError

Fn = TypeVar("Fn", bound=Callable[..., object])


def record(fn: Fn, error_handler: object | None = None) -> Fn:
    """The entry point itself: spmdrun records a worker's failure without a decorator."""
    return fn


__all__ = ["ChildFailedError", "record"]
