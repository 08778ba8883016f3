"""The split backward: I then W give the gradients of one full backward, with the work of one full backward
(matmul flops counted by a dispatch mode), each weight's gradient accumulated once, in one backward pass. On
thread ranks, a zero-bubble schedule's step computes exactly the flops of the same stages' unsplit schedule."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from examples.gpt import GPT, GPTConfig
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from spmd.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from spmd.pipelining.backward import backward_input
from spmd.testing import run_ranks, seeded
from tests.pipelining.test_runtime import batch, build_stages, gpt, loss_fn


class Flops(TorchDispatchMode):
    """Counts the flops of the matmul-like ops (torch's flop counter formulas) run on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **(kwargs or {}), out_val=out)
        return out


def _gpt_tail() -> nn.Module:
    """A non-first stage: two blocks, the final norm and the head."""
    with seeded(0):
        model = GPT(GPTConfig(vocab=32, context=8, layers=2, width=16, heads=2))
    return nn.Sequential(*model.blocks, model.ln, model.head)


def _backward(module: nn.Module, x_full: Tensor, split: bool) -> tuple[Tensor, dict[str, Tensor], list[int],
                                                                           dict[str, int]]:
    """Gradients of one backward of `module` at `x_full` (seeded with fixed output gradients), the flops of each
    part (B; or I and W), and how often each parameter's gradient was accumulated."""
    module = copy.deepcopy(module)
    x = x_full.clone().requires_grad_()
    out = module(x)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    fired: dict[str, int] = {}
    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    flops = []
    if split:
        with Flops() as counter:
            (x_grad,), weight_half = backward_input([out], [seed], [x])
        flops.append(counter.flops)
        assert not fired and all(p.grad is None for p in module.parameters())   # I leaves the weights alone
        with Flops() as counter:
            weight_half.run()
        flops.append(counter.flops)
    else:
        with Flops() as counter:
            torch.autograd.backward([out], [seed])
        flops.append(counter.flops)
        x_grad = x.grad
    return x_grad, {name: p.grad for name, p in module.named_parameters()}, flops, fired


def test_input_then_weight_half_is_one_backward() -> None:
    module, x = _gpt_tail(), torch.randn(4, 8, 16)
    want_x, want, (full,) = _backward(module, x, split=False)[:3]
    got_x, got, (input_half, weight_half), fired = _backward(module, x, split=True)
    torch.testing.assert_close(got_x, want_x)
    assert sorted(got) == sorted(want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], msg=name)
    assert input_half + weight_half == full                  # no matmul done twice
    assert 0 < input_half < full and 0 < weight_half < full
    assert fired == dict.fromkeys(want, 1)                   # each weight accumulated once


class Shared(nn.Module):
    """A weight used twice in a row (one part, two entries, one below the other), and an output that depends on
    no input (a part started from its own gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.lin(torch.tanh(self.lin(x))), (self.scale * 2).exp()


def test_shared_weights_and_outputs_without_inputs_get_the_full_backward_gradients() -> None:
    with seeded(0):
        module, x = Shared(), torch.randn(4, 6)

    def grads(split: bool) -> tuple[Tensor, list[Tensor]]:
        local = copy.deepcopy(module)
        leaf = x.clone().requires_grad_()
        outs = list(local(leaf))
        seeds = [torch.full_like(out, 0.5) for out in outs]
        if split:
            (x_grad,), weight_half = backward_input(outs, seeds, [leaf])
            weight_half.run()
        else:
            torch.autograd.backward(outs, seeds)
            x_grad = leaf.grad
        return x_grad, [p.grad for p in local.parameters()]

    (want_x, want), (got_x, got) = grads(False), grads(True)
    torch.testing.assert_close(got_x, want_x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


_build_lock = threading.Lock()


@pytest.mark.parametrize("unsplit, split, style", [(ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, "loop"),
                                                   (ScheduleDualPipeV, ScheduleZBVZeroBubble, "v")],
                         ids=["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_a_zero_bubble_step_computes_what_the_unsplit_step_computes(unsplit: type, split: type, style: str) -> None:
    """Per rank: the same flops and the same gradients as a schedule that runs whole backwards on the same
    stages (DualPipeV mostly does), so no microbatch's backward is computed twice."""
    model = gpt(layers=4)
    tokens, targets = batch(0)

    def body(rank: int, world_size: int) -> tuple[list[int], list[dict[str, Tensor]]]:
        flops, grads = [], []
        for cls in (unsplit, split):
            with _build_lock:
                stages, local = build_stages(model, rank, world_size, 2, style)
            schedule = cls(stages, 4, loss_fn=loss_fn)
            names = {id(p): k for k, p in local.named_parameters()}
            last = any(stage.is_last for stage in stages)
            with Flops() as counter:
                schedule.step(*((tokens,) if rank == 0 else ()), target=targets if last else None)
            flops.append(counter.flops)
            grads.append({names[id(p)]: p.grad for s in stages for p in s.submod.parameters()})
        return flops, grads

    for flops, (want, got) in run_ranks(body, world_size=2, timeout=60.0):
        assert flops[0] == flops[1] > 0
        assert sorted(got) == sorted(want)
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
