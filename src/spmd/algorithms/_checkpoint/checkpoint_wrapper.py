"""Activation checkpointing and offloading as module wrappers (torch's `checkpoint_wrapper` module, which
TorchTitan and the FSDP tutorials import): a wrapped module recomputes its activations in backward, or keeps
them in host memory, and is otherwise the module it wraps.

Layer: algorithms (imports torch and spmd.fsdp.wrap's policies). Nothing here communicates, so the wrappers
compose with every parallelism: apply them before `fully_shard` or DDP, as TorchTitan does.

Note: the wrapped module's names
A wrapper holds its module as the child `_checkpoint_wrapped_module`, which adds that component to the names of
everything below it. As in torch, `state_dict()` leaves it out (at every level: a hook of each wrapper) and
`load_state_dict()` accepts the plain names, so checkpoints move between wrapped and plain models; the wrapper's
own `named_parameters()` leaves it out too, but a parent's `named_parameters()` and `named_modules()` keep it.
spmd.checkpoint's state dicts drop it from every FQN (model and optimizer), as torch's DCP does. Attribute reads
and indexing the wrapper lacks go to the wrapped module.
"""

from __future__ import annotations

import abc
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu

from spmd.fsdp.wrap import Policy, PolicyFn, lambda_auto_wrap_policy, wrap_modules

__all__ = ["ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper",
           "apply_activation_checkpointing", "checkpoint_wrapper", "offload_wrapper"]

_WRAPPED = "_checkpoint_wrapped_module"
_PREFIX = _WRAPPED + "."


class CheckpointImpl(enum.Enum):
    """torch.utils.checkpoint's two implementations: reentrant (a nested backward) or not (saved-tensor hooks,
    the default and the one torch recommends)."""

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


class ActivationWrapper(nn.Module, abc.ABC):
    """A module that runs its wrapped module differently and otherwise is it (see Note: the wrapped module's
    names)."""

    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = mod
        self.register_state_dict_post_hook(_drop_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, run the wrapper's way."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._checkpoint_wrapped_module[key]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_PREFIX, ""), param


def _drop_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    _rename(state_dict, prefix + _PREFIX, lambda key: prefix + key[len(prefix + _PREFIX):])


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    wrapped = prefix + _PREFIX      # keys that already carry it (a state dict saved with raw names) stay
    _rename(state_dict, prefix, lambda key: key if key.startswith(wrapped) else wrapped + key[len(prefix):])


def _rename(state_dict: dict[str, Any], start: str, renamed: Callable[[str], str]) -> None:
    """Rename, in place and keeping the key order, every key that begins with `start`."""
    for key in list(state_dict):
        value = state_dict.pop(key)
        state_dict[renamed(key) if key.startswith(start) else key] = value


class OffloadWrapper(ActivationWrapper):
    """Keeps the wrapped module's saved activations in (pinned) host memory until backward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=True):
            return self._checkpoint_wrapped_module(*args, **kwargs)


class CheckpointWrapper(ActivationWrapper):
    """Recomputes the wrapped module's forward in backward instead of saving its activations."""

    def __init__(self, mod: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                 checkpoint_fn: Callable[..., Any] | None = None, **checkpoint_fn_kwargs: Any) -> None:
        super().__init__(mod)
        if not isinstance(checkpoint_impl, CheckpointImpl):
            raise TypeError(f"checkpoint_wrapper: checkpoint_impl must be a CheckpointImpl, got {checkpoint_impl!r}")
        self.checkpoint_impl = checkpoint_impl
        if checkpoint_fn is None:
            self.checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint,
                                                   use_reentrant=checkpoint_impl is CheckpointImpl.REENTRANT,
                                                   **checkpoint_fn_kwargs)
        else:
            self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._checkpoint_wrapped_module
        if self.checkpoint_impl is CheckpointImpl.REENTRANT and kwargs:
            # reentrant checkpointing passes positional inputs only: the keyword values travel after them
            names, count = tuple(kwargs), len(args)

            def run(*inputs: Any) -> Any:
                return module(*inputs[:count], **dict(zip(names, inputs[count:], strict=True)))
            return self.checkpoint_fn(run, *args, *kwargs.values())
        return self.checkpoint_fn(module, *args, **kwargs)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """`module` with its saved activations offloaded to host memory."""
    return OffloadWrapper(module)


def checkpoint_wrapper(module: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                       checkpoint_fn: Callable[..., Any] | None = None, **checkpoint_fn_kwargs: Any) -> nn.Module:
    """`module` recomputing its activations in backward: with torch.utils.checkpoint (`checkpoint_impl`, the
    kwargs passed on), or with `checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)` if given."""
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def apply_activation_checkpointing(model: nn.Module,
                                   checkpoint_wrapper_fn: Callable[..., nn.Module] = checkpoint_wrapper,
                                   check_fn: Callable[[nn.Module], bool] = lambda _: True,
                                   auto_wrap_policy: PolicyFn | Policy | None = None) -> None:
    """Wrap, in place, each submodule of `model` that `check_fn` accepts (or `auto_wrap_policy` picks, which
    takes precedence) with `checkpoint_wrapper_fn`, innermost first; `model` itself is never wrapped."""
    policy = auto_wrap_policy if auto_wrap_policy is not None else functools.partial(lambda_auto_wrap_policy,
                                                                                     lambda_fn=check_fn)
    wrap_modules(model, policy, checkpoint_wrapper_fn)
