"""Optimizers stepped during backward (torch's `_apply_optimizer_in_backward`): each parameter's optimizer steps
as soon as its gradient is ready, then frees the gradient, so a whole model's gradients never exist at once.

Layer 4. The step runs in the parameter's post-accumulate-grad hook. Under data parallelism the gradient must be
reduced first: FSDP2 runs the sharded parameter's hooks once its gradient is reduced (so the hook steps the
shard with the average), and DistributedDataParallel, finding the optimizers on its parameters (the
`_in_backward_optimizers` attribute, as torch's DDP looks for), defers them: the hook stands aside
(`_ddp_steps_in_backward`) and DDP steps them once each bucket's average is written back. The protocol itself
lives in spmd._autograd, which DDP shares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from spmd._autograd import DDP_STEPS_IN_BACKWARD, add_in_backward_optimizer, in_backward_optimizers, step_in_backward


def _apply_optimizer_in_backward(optimizer_class: type[torch.optim.Optimizer], params: Iterable[nn.Parameter],
                                 optimizer_kwargs: dict[str, Any], register_hook: bool = True) -> None:
    """Give each of `params` an `optimizer_class(param, **optimizer_kwargs)` that steps when backward has
    accumulated its gradient, then sets the gradient to None (another optimizer over these parameters then has
    nothing to step). With register_hook=False the optimizers are only attached (`_in_backward_optimizers`), for
    a wrapper that steps them itself."""
    for param in params:
        add_in_backward_optimizer(param, optimizer_class([param], **optimizer_kwargs), optimizer_class,
                                  optimizer_kwargs)
        if register_hook and not getattr(param, "_in_backward_hooked", False):
            param.register_post_accumulate_grad_hook(_step_unless_ddp_does)     # one hook steps them all
            param._in_backward_hooked = True        # type: ignore[attr-defined]


def _step_unless_ddp_does(param: torch.Tensor) -> None:
    if not getattr(param, DDP_STEPS_IN_BACKWARD, False):
        step_in_backward(param)


def _get_in_backward_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The in-backward optimizers of `module`'s parameters (for checkpointing their state; not to be stepped)."""
    return [optimizer for param in module.parameters() for optimizer in in_backward_optimizers(param)]
