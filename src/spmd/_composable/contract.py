"""torch's `contract`: the decorator that turns `fn(module, ...)` into a composable API, which attaches a state
object to the module, records itself in the module's registry and refuses to be applied twice.

Layer: _composable. spmd's own composable APIs (fully_shard, both replicates, checkpoint) appear in
`_get_registry` as torch's do, so code that asks whether a module is managed by one of them ports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from spmd._composable.replicate import replicate as replicate_by_ddp
from spmd.fsdp.replicate import ReplicateModule
from spmd.fsdp.state import state_of

_REGISTRY_ATTR = "_spmd_composable_registry"


class _State:
    """The base of a composable API's per-module state."""


class RegistryItem:
    """One entry of a module's registry: the API applied to it."""


def contract(state_cls: type[_State] = _State) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate `fn(module, *args, **kwargs) -> module`: applying it attaches a `state_cls()` (read back with
    `fn.state(module)`) and records `fn.__name__` in the module's registry; applying it twice to one module is a
    RuntimeError, and so is a fn that returns another module or changes the module's parameter names."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        key = f"_spmd_composable_state_{name}"

        @functools.wraps(fn)
        def apply(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            registry = module.__dict__.setdefault(_REGISTRY_ATTR, {})
            if name in registry:
                raise RuntimeError(f"{name}: already applied to {type(module).__name__}; apply each composable API "
                                   f"once per module")
            before = [n for n, _ in module.named_parameters()]
            module.__dict__[key] = state_cls()
            registry[name] = RegistryItem()
            result = fn(module, *args, **kwargs)
            if result is None:
                result = module
            if result is not module:
                raise RuntimeError(f"{name}: a composable API must return the module it was given, got a "
                                   f"{type(result).__name__}")
            after = [n for n, _ in module.named_parameters()]
            if after != before:
                raise RuntimeError(f"{name}: a composable API must keep the module's parameter names; "
                                   f"{sorted(set(before) ^ set(after))[:5]} changed")
            return result

        def state(module: nn.Module) -> Any:
            return module.__dict__.get(key)

        apply.state = state   # type: ignore[attr-defined]
        return apply

    return decorate


def _get_registry(module: nn.Module) -> dict[str, RegistryItem] | None:
    """The composable APIs applied to `module`, by name (torch's: fully_shard, replicate, checkpoint, and any
    `contract` API), or None when none was."""
    registry = dict(module.__dict__.get(_REGISTRY_ATTR, {}))
    if state_of(module) is not None:
        registry["replicate" if isinstance(module, ReplicateModule) else "fully_shard"] = RegistryItem()
    if replicate_by_ddp.state(module) is not None:   # type: ignore[attr-defined]
        registry["replicate"] = RegistryItem()
    return registry or None
