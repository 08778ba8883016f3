"""Host bookkeeping under torch's FakeTensorMode: a mesh's rank table is a real host tensor, and the ops on it
must run as real ops even while a FakeTensorMode traces a model (as TorchTitan's memory estimation does), which
would otherwise refuse a real tensor (or make the table fake, its values unreadable).

Layer: _core.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def real_tensors() -> contextlib.AbstractContextManager[Any]:
    """A context in which no FakeTensorMode is active (torch's unset_fake_temporarily); a no-op, without importing
    fake tensors (a second), when nothing has imported them, so none can be active."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module.unset_fake_temporarily() if module is not None else contextlib.nullcontext()


def on_real_tensors(fn: _Fn) -> _Fn:
    """`fn` run under real_tensors()."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with real_tensors():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]
