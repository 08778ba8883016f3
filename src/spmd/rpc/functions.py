"""rpc.functions.async_execution: a function that returns a Future, whose value the caller receives once it is
set, without holding a thread of the callee meanwhile (torch's path).

Layer: rpc.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark `fn` (which returns a torch.futures.Future) so that a call of it over RPC answers with the Future's
    value when it is set. Put it under @staticmethod / @classmethod, as torch asks."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._spmd_async_execution = True       # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "_spmd_async_execution", False))
