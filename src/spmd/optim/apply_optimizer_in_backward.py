"""Optimizers stepped during backward (torch's `_apply_optimizer_in_backward`): each parameter's optimizer steps
as soon as its gradient is ready, then frees the gradient, so a whole model's gradients never exist at once.

Layer 4. The step runs in the parameter's post-accumulate-grad hook. Under data parallelism the gradient must be
reduced first: FSDP2 runs the sharded parameter's hooks once its gradient is reduced (so the hook steps the
shard with the average), and DistributedDataParallel, finding the optimizers on its parameters (the
`_in_backward_optimizers` attribute, as torch's DDP looks for), defers them: the hook stands aside
(`_ddp_steps_in_backward`) and DDP steps them once each bucket's average is written back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

DDP_STEPS = "_ddp_steps_in_backward"     # set on a parameter by DDP (reducer.py): its all-reduce first, then the step


def _apply_optimizer_in_backward(optimizer_class: type[torch.optim.Optimizer], params: Iterable[nn.Parameter],
                                 optimizer_kwargs: dict[str, Any], register_hook: bool = True) -> None:
    """Give each of `params` an `optimizer_class(param, **optimizer_kwargs)` that steps when backward has
    accumulated its gradient, then sets the gradient to None (another optimizer over these parameters then has
    nothing to step). With register_hook=False the optimizers are only attached (`_in_backward_optimizers`), for
    a wrapper that steps them itself."""
    for param in params:
        optimizer = optimizer_class([param], **optimizer_kwargs)
        if not hasattr(param, "_in_backward_optimizers"):
            param._in_backward_optimizers = []      # type: ignore[attr-defined]
            param._optimizer_classes = []           # type: ignore[attr-defined]
            param._optimizer_kwargs = []            # type: ignore[attr-defined]
        if register_hook and not getattr(param, "_in_backward_hooked", False):
            param.register_post_accumulate_grad_hook(_step_in_backward)     # one hook steps them all
            param._in_backward_hooked = True        # type: ignore[attr-defined]
        param._in_backward_optimizers.append(optimizer)   # type: ignore[attr-defined]
        param._optimizer_classes.append(optimizer_class)  # type: ignore[attr-defined]
        param._optimizer_kwargs.append(optimizer_kwargs)  # type: ignore[attr-defined]


def _step_in_backward(param: torch.Tensor) -> None:
    if getattr(param, DDP_STEPS, False):
        return
    for optimizer in param._in_backward_optimizers:      # type: ignore[attr-defined]
        optimizer.step()
    param.grad = None


def _get_in_backward_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The in-backward optimizers of `module`'s parameters (for checkpointing their state; not to be stepped)."""
    return [optimizer for param in module.parameters()
            for optimizer in getattr(param, "_in_backward_optimizers", [])]
