"""Wrap policies: which submodules of a model a wrapper applies to (torch's `fsdp.wrap` module), for
`apply_activation_checkpointing` and for code that walks a model the way FSDP1's auto-wrapping did.

Layer: fsdp. Pure module-tree logic; nothing here communicates. spmd shards with `fully_shard` (FSDP2), which
is applied per module by the caller, so these policies serve activation checkpointing and user wrappers.

A policy is either a callable `policy(module=, recurse=, nonwrapped_numel=) -> bool` (asked with recurse=True
whether to descend into a module, with recurse=False whether to wrap it, `nonwrapped_numel` counting the
parameters not already inside a wrapped child), or a `Policy` object that names the modules to wrap (and the
wrapper's keyword arguments for each) in one pass over the tree.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

__all__ = ["CustomPolicy", "ModuleWrapPolicy", "always_wrap_policy", "enable_wrap", "lambda_auto_wrap_policy",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "wrap"]

PolicyFn = Callable[..., bool]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Descend everywhere; wrap the modules for which `lambda_fn(module)` is true (bind it with functools.partial)."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Descend everywhere; wrap each instance of the given layer classes (a transformer's blocks)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


FORCE_LEAF_MODULES = frozenset({nn.MultiheadAttention})   # its parameters are used outside its forward
EXCLUDE_WRAP_MODULES = frozenset({nn.ModuleList, nn.ModuleDict})   # containers without a forward


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wrap a module once the parameters not yet wrapped below it reach `min_num_params`; never descend into
    `force_leaf_modules` (default: MultiheadAttention) nor wrap `exclude_wrap_modules` (ModuleList/Dict)."""
    leaves = tuple(FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    excluded = tuple(EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    large = nonwrapped_numel >= min_num_params
    if recurse:
        return large and not isinstance(module, leaves)
    return large and not isinstance(module, excluded)


class Policy(abc.ABC):
    """A policy that names its modules in one pass: `targets(root)` maps each module to wrap to the keyword
    arguments its wrapper gets (torch's `_Policy`)."""

    @abc.abstractmethod
    def targets(self, root: nn.Module, ignored_modules: set[nn.Module] | None = None) -> dict[nn.Module, dict]:
        """The modules of `root`'s tree to wrap (none of `ignored_modules`), each with its wrapper's kwargs."""


class ModuleWrapPolicy(Policy):
    """Wrap every instance of the given module classes."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = tuple(dict.fromkeys(module_classes))

    def targets(self, root: nn.Module, ignored_modules: set[nn.Module] | None = None) -> dict[nn.Module, dict]:
        ignored = ignored_modules or set()
        return {module: {} for module in root.modules()
                if module not in ignored and isinstance(module, self._module_classes)}

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[cls.__name__ for cls in self._module_classes]})"


class CustomPolicy(Policy):
    """Wrap the modules for which `lambda_fn(module)` is truthy; a dict result is that wrapper's keyword
    arguments (e.g. per-module options), True means none."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def targets(self, root: nn.Module, ignored_modules: set[nn.Module] | None = None) -> dict[nn.Module, dict]:
        ignored = ignored_modules or set()
        chosen: dict[nn.Module, dict] = {}
        for module in root.modules():
            if module in ignored:
                continue
            verdict = self._lambda_fn(module)
            if not isinstance(verdict, (bool, dict)):
                raise ValueError(f"CustomPolicy: lambda_fn must return a bool or a dict of wrapper kwargs, got "
                                 f"{verdict!r} for {type(module).__name__}")
            if verdict:
                chosen[module] = dict(verdict) if isinstance(verdict, dict) else {}
        return chosen


def wrap_modules(root: nn.Module, policy: PolicyFn | Policy, wrapper: Callable[..., nn.Module],
                 ignored_modules: set[nn.Module] | None = None) -> None:
    """Replace, in place, each submodule of `root` that `policy` picks by `wrapper(module, **kwargs)`, children
    before parents; `root` itself is never replaced (it has no parent to hold the wrapper)."""
    ignored = ignored_modules or set()
    if isinstance(policy, Policy):
        chosen = policy.targets(root, ignored)
        _replace_post_order(root, lambda module: wrapper(module, **chosen[module]) if module in chosen else None)
        return
    if not callable(policy):
        raise TypeError(f"a wrap policy is a callable (module, recurse, nonwrapped_numel) -> bool or a Policy "
                        f"such as ModuleWrapPolicy, got {policy!r}")
    ignored_params = {p for module in ignored for p in module.parameters()}
    for name, child in root.named_children():
        if child not in ignored:
            wrapped, _ = _wrap_recursively(child, policy, wrapper, ignored, ignored_params)
            setattr(root, name, wrapped)


def _wrap_recursively(module: nn.Module, policy: PolicyFn, wrapper: Callable[..., nn.Module],
                      ignored: set[nn.Module], ignored_params: set[nn.Parameter]) -> tuple[nn.Module, int]:
    """`module` wrapped as `policy` says (its children first) and the number of parameters now inside wrappers."""
    numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        if child in ignored:
            continue
        wrapped, count = _wrap_recursively(child, policy, wrapper, ignored, ignored_params)
        setattr(module, name, wrapped)
        wrapped_numel += count
    if policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped_numel):
        return wrapper(module), numel
    return module, wrapped_numel


def _replace_post_order(root: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> None:
    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            visit(child)
            new = replacement(child)
            if new is not None and new is not child:
                setattr(module, name, new)
    visit(root)


_wrap_context: contextvars.ContextVar[tuple[tuple[Callable[..., nn.Module], dict[str, Any]], ...]] = \
    contextvars.ContextVar("spmd_enable_wrap", default=())


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block, `wrap(module)` returns `wrapper_cls(module, **wrapper_kwargs)` (per thread, so thread
    ranks don't see each other's blocks)."""
    token = _wrap_context.set((*_wrap_context.get(), (wrapper_cls, wrapper_kwargs)))
    try:
        yield
    finally:
        _wrap_context.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """`module` wrapped with the innermost `enable_wrap`'s wrapper (its kwargs updated by `wrap_overrides`), or
    `module` itself outside any enable_wrap."""
    stack = _wrap_context.get()
    if not stack:
        return module
    wrapper_cls, kwargs = stack[-1]
    return wrapper_cls(module, **{**kwargs, **wrap_overrides})
