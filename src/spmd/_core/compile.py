"""Living beside torch.compile without paying for it: code run eagerly when a compiled function reaches it, and
dynamo told about spmd's code only once dynamo is imported.

Layer: core. torch._dynamo costs a process 1.5 s to import, and most spmd processes never compile, so nothing
here imports it: `when_dynamo_imported` runs its callbacks right after torch.compile (or anything else) first
imports it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

_Fn = Callable[..., Any]


def eager_under_compile(fn: _Fn) -> _Fn:
    """`fn`, run eagerly when torch.compile reaches it (spmd.tensor.api, Note: DTensors under torch.compile)."""
    disabled: _Fn | None = None

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if not _under_compile():
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    run._torchdynamo_disable = True   # type: ignore[attr-defined]   # dynamo's mark: call it, never inline it
    return run


def _under_compile() -> bool:
    """Whether dynamo is tracing, or a compiled function is running (its frames between graphs are eager, but
    dynamo would compile every Python frame they enter). Dynamo reads the first answer as a constant, so it never
    meets the builtin."""
    return torch.compiler.is_compiling() or get_eval_frame_callback() is not None


_WRAPPER_CODE = eager_under_compile(_under_compile).__code__   # every eager_under_compile wrapper's code

# Note: objects in compiled graphs
# torch.compile holds spmd's meshes and process groups as opaque VALUES: constants of its graphs, guarded by
# __eq__, their queries answered at compile time. The graph's generated code must still name each one: their
# __fx_repr__ is `fx_name(self)`, a lookup in a weak table filled as the code is generated.
_GRAPH_CONSTANTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _graph_constant(key: int) -> Any:
    """The object a compiled graph's code names (see Note: objects in compiled graphs)."""
    return _GRAPH_CONSTANTS[key]


def fx_name(obj: Any) -> tuple[str, dict[str, Any]]:
    """`obj`'s __fx_repr__: how a compiled graph's code names it (see Note: objects in compiled graphs)."""
    _GRAPH_CONSTANTS[id(obj)] = obj
    return f"_graph_constant({id(obj)})", {"_graph_constant": _graph_constant}


_pending: list[Callable[[ModuleType], None]] = []


def when_dynamo_imported(then: Callable[[ModuleType], None]) -> None:
    """Run `then(torch._dynamo)` now if dynamo is imported, else right after it first is."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        then(dynamo)
        return
    if not _pending:
        sys.meta_path.insert(0, _OnDynamoImport())
    _pending.append(then)


def disable_once_dynamo_imported(cls: type, names: Iterable[str], *, recursive: bool = True) -> None:
    """torch.compiler.disable `cls`'s methods `names` right after dynamo is first imported (now if it is): what
    decorating them does, without importing dynamo in a process that never compiles."""
    names = tuple(names)

    def disable(dynamo: ModuleType) -> None:
        for name in names:
            setattr(cls, name, torch.compiler.disable(vars(cls)[name], recursive=recursive))

    when_dynamo_imported(disable)


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """Runs the pending callbacks right after torch._dynamo is first imported (one finder for all of them: the
    first finder to answer for a module is the only one asked)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            callbacks = list(_pending)
            _pending.clear()
            for then in callbacks:
                then(module)

        spec.loader.exec_module = exec_then   # type: ignore[method-assign]   # this spec's loader only
        return spec


when_dynamo_imported(lambda dynamo: dynamo.eval_frame.skip_code(_WRAPPER_CODE))   # the wrappers' frames stay eager
