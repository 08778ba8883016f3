"""checkpoint: activation checkpointing applied to a module by hooks (torch's `_composable.checkpoint`), so the
model's code and its parameter names stay as they are.

Layer: _composable. Its forward-pre hook opens torch's non-reentrant checkpoint around the module's forward and
its forward hook closes it: the forward saves only its inputs, and backward recomputes the forward (with the
hooks off) to get the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

from spmd._composable.contract import _State, contract


class _CheckpointState(_State):
    def __init__(self) -> None:
        self.enable_hook = False
        self.generator: Generator[None, None, None] | None = None


@contextlib.contextmanager
def _hooks_off(module: nn.Module, user_context: contextlib.AbstractContextManager | None) -> Iterator[None]:
    """The recomputation's context: the user's, with this module's hooks off (they must not checkpoint the
    recomputation itself)."""
    state = checkpoint.state(module)   # type: ignore[attr-defined]
    with user_context if user_context is not None else contextlib.nullcontext():
        previous, state.enable_hook = state.enable_hook, False
        try:
            yield
        finally:
            state.enable_hook = previous


@contract(_CheckpointState)
def checkpoint(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Checkpoint `module`'s activations: its forward keeps only its inputs; backward recomputes the rest.
    Takes torch.utils.checkpoint's non-reentrant options: `preserve_rng_state` (True), `context_fn`,
    `determinism_check`, `debug`, `early_stop`; `use_reentrant=True` is refused, as in torch."""
    if kwargs.pop("use_reentrant", False):
        raise NotImplementedError("checkpoint: use_reentrant=True is not served by the composable checkpoint (nor "
                                  "by torch's); use torch.utils.checkpoint.checkpoint")
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    user_context_fn: Callable[[], tuple[Any, Any]] | None = kwargs.pop("context_fn", None)
    determinism_check = kwargs.pop("determinism_check", _DEFAULT_DETERMINISM_MODE)
    debug = kwargs.pop("debug", False)
    early_stop = kwargs.pop("early_stop", True)
    if kwargs:
        raise ValueError(f"checkpoint: unexpected keyword arguments {sorted(kwargs)}")
    state: _CheckpointState = checkpoint.state(module)   # type: ignore[attr-defined]

    def contexts() -> tuple[Any, Any]:
        if user_context_fn is None:
            return contextlib.nullcontext(), _hooks_off(module, None)
        forward_context, recompute_context = user_context_fn()
        return forward_context, _hooks_off(module, recompute_context)

    def pre_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if state.enable_hook:
            state.generator = _checkpoint_without_reentrant_generator(
                module, preserve_rng_state, contexts, determinism_check, debug, early_stop, *args, **kwargs)
            next(state.generator)

    def post_forward(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        generator, state.generator = state.generator, None
        if state.enable_hook and generator is not None:
            for _ in generator:
                raise RuntimeError("checkpoint: torch's checkpoint generator yielded more than twice")

    state.enable_hook = True
    module.register_forward_pre_hook(pre_forward, with_kwargs=True)
    module.register_forward_hook(post_forward, prepend=True, always_call=True)
    return module
