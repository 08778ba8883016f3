"""Higher-order operators (flex_attention, cond, ...) inside spmd's TorchDispatchModes.

Layer: core. A TorchDispatchMode meets a higher-order operator only if it says it supports them, else torch
raises NotImplementedError ("no rule registered for HigherOrderOperator flex_attention and mode ..."): that is
what spmd's memory trackers and CommDebugMode did to any model using flex_attention. A mode that wants to see the
operator's inner ops runs its eager implementation with the mode pushed again (`run_inside`); one that only
needs the outputs calls the operator, which then runs below the mode.
"""

from __future__ import annotations

from typing import Any

from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode


def is_higher_order(func: Any) -> bool:
    """Whether a __torch_dispatch__ call is a higher-order operator's (not an aten op's)."""
    return isinstance(func, HigherOrderOperator)


def run_inside(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple, kwargs: dict | None) -> Any:
    """Run higher-order operator `func` from `mode`'s __torch_dispatch__ so that the aten ops of its eager
    implementation come back through `mode` (flex_attention's score matrix counts in a memory peak): its
    CompositeExplicitAutograd kernel, under `mode` pushed again (as a TorchDispatchMode only: a subclass's own
    __enter__ is not run again). An operator without such a kernel runs as is, its inner ops unseen."""
    dense = func.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
    if dense is None:
        return func(*args, **(kwargs or {}))
    TorchDispatchMode.__enter__(mode)
    try:
        return dense(*args, **(kwargs or {}))
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)
