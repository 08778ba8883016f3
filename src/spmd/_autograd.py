"""Autograd plumbing for the data-parallel wrappers: run code when a backward pass reaches given tensors, when a
parameter's gradient has been accumulated, and once when the running backward pass ends; and the optimizers a
parameter steps in backward (torch's `_in_backward_optimizers` protocol), which DDP and the optim package share.

Layer: _autograd (beside _core, below comm). It imports torch and nothing from spmd, so that DDP and FSDP,
siblings at layer 4 that must not import each other, share it. Nothing here communicates. It is not in `_core`
because `_core` stays torch-free for the launcher.

Note: which backward a callback belongs to
Autograd runs one graph task per `backward()` / `autograd.grad()` call, and reentrant activation checkpointing
runs nested graph tasks inside the outer one. `at_backward_end` queues its callback on the graph task that runs
the calling hook, so code that must run once after the whole backward queues it from a hook of the outermost
task: the first gradient reaching a forward output (`on_backward_reaching`) is one such hook, as every
backward through the model starts at its outputs. A parameter's gradient hook may fire in a nested task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle


class HookHandles:
    """The hooks one registration made; `remove()` unregisters all of them (idempotent)."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def in_backward() -> bool:
    """True when called from inside a backward pass (a hook or callback the autograd engine runs)."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback()` once, after the backward pass that runs the calling hook has computed and accumulated
    every gradient (see Note: which backward a callback belongs to).

    Callbacks run in the order queued, on the thread that runs that backward; none runs if the backward raises.
    Call it from a hook during backward; elsewhere it raises RuntimeError.
    """
    if not in_backward():
        raise RuntimeError("at_backward_end: called outside a backward pass; call it from a hook that autograd "
                           "runs during backward (on_backward_reaching, on_grad_accumulated)")
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def after_backward_through(tensors: Sequence[Tensor], callback: Callable[[], None]) -> RemovableHandle | None:
    """Call `callback()` in each backward pass that reaches `tensors`, once the gradients of all of them that the
    pass computes are computed: backward has passed through everything that produced them.

    Tensors that don't require grad are skipped; returns None when none does. The hook lives with their graph.
    """
    watched = [tensor for tensor in tensors if tensor.requires_grad]
    if not watched:
        return None
    return torch.autograd.graph.register_multi_grad_hook(watched, lambda _grads: callback(), mode="all")


def on_backward_reaching(tensors: Sequence[Tensor], callback: Callable[[], None]) -> RemovableHandle | None:
    """Call `callback()` in each backward pass that reaches any of `tensors`, once per pass, as soon as the first of
    their gradients is computed (before it flows further back through them).

    Tensors that don't require grad are skipped; returns None when none does. The hook lives with their graph.
    """
    watched = [tensor for tensor in tensors if tensor.requires_grad]
    if not watched:
        return None
    return torch.autograd.graph.register_multi_grad_hook(watched, lambda _grad: callback(), mode="any")


def on_grad_accumulated(params: Sequence[Tensor], callback: Callable[[int], None]) -> HookHandles:
    """Call `callback(i)` each time a backward pass has accumulated `params[i].grad` (read it there).

    Once per parameter per backward pass, or more often when nested backwards reach it again (reentrant
    activation checkpointing). The hooks stay until `remove()` is called on the returned handles.
    """
    return HookHandles([param.register_post_accumulate_grad_hook(_indexed(callback, index))
                        for index, param in enumerate(params)])


def _indexed(callback: Callable[[int], None], index: int) -> Callable[[Tensor], None]:
    def hook(_param: Tensor) -> None:
        callback(index)
    return hook


# -- optimizers stepped in backward (torch's protocol: a parameter's `_in_backward_optimizers` list) -------------

DDP_STEPS_IN_BACKWARD = "_ddp_steps_in_backward"   # on a parameter whose in-backward optimizers DDP steps, after
                                                  # its bucket's average is written back (ddp/reducer.py)


def add_in_backward_optimizer(param: Tensor, optimizer: torch.optim.Optimizer, optimizer_class: type,
                              optimizer_kwargs: dict) -> None:
    """Attach `optimizer` to `param` as torch's _apply_optimizer_in_backward does (its class and kwargs beside it,
    for checkpointing)."""
    if not hasattr(param, "_in_backward_optimizers"):
        param._in_backward_optimizers = []      # type: ignore[attr-defined]
        param._optimizer_classes = []           # type: ignore[attr-defined]
        param._optimizer_kwargs = []            # type: ignore[attr-defined]
    param._in_backward_optimizers.append(optimizer)   # type: ignore[attr-defined]
    param._optimizer_classes.append(optimizer_class)  # type: ignore[attr-defined]
    param._optimizer_kwargs.append(optimizer_kwargs)  # type: ignore[attr-defined]


def in_backward_optimizers(param: Tensor) -> list[torch.optim.Optimizer]:
    return getattr(param, "_in_backward_optimizers", [])


def step_in_backward(param: Tensor) -> None:
    """Step `param`'s in-backward optimizers on its gradient, then free the gradient."""
    for optimizer in in_backward_optimizers(param):
        optimizer.step()
    param.grad = None
