"""spmd._autograd: the backward-start, gradient-accumulated and backward-end hooks DDP and FSDP build on.

Plain torch autograd in one process, no communication: each test records the order in which the hooks fire
during a backward pass and checks it against what the docstrings promise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from spmd._autograd import at_backward_end, in_backward, on_backward_reaching, on_grad_accumulated


def test_at_backward_end_runs_once_after_every_gradient() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    log: list[object] = []

    def on_grad(index: int) -> None:
        log.append(index)
        if index == 0:   # queued from a hook that is not the last to fire: still runs after all of them
            at_backward_end(lambda: log.append(("end", [p.grad is not None for p in params])))

    handles = on_grad_accumulated(params, on_grad)
    model(torch.randn(5, 3)).sum().backward()
    assert sorted(log[:-1]) == [0, 1, 2, 3]
    assert log[-1] == ("end", [True] * 4)

    log.clear()
    handles.remove()
    handles.remove()   # idempotent
    model(torch.randn(5, 3)).sum().backward()
    assert log == []


def test_callbacks_run_in_the_order_queued_and_not_when_backward_raises() -> None:
    x = torch.randn(3, requires_grad=True)
    log: list[str] = []
    y = x * 2

    def queue_two(_grad: torch.Tensor) -> None:
        at_backward_end(lambda: log.append("first"))
        at_backward_end(lambda: log.append("second"))

    y.register_hook(queue_two)
    y.sum().backward()
    assert log == ["first", "second"]

    log.clear()
    z = x * 3

    def queue_then_fail(_grad: torch.Tensor) -> None:
        at_backward_end(lambda: log.append("ran"))
        raise ValueError("boom")

    z.register_hook(queue_then_fail)
    with pytest.raises(ValueError, match="boom"):
        z.sum().backward()
    assert log == []


def test_at_backward_end_outside_backward_is_an_error() -> None:
    assert not in_backward()
    with pytest.raises(RuntimeError, match="outside a backward pass"):
        at_backward_end(lambda: None)


def test_on_backward_reaching_fires_once_per_pass_before_parameter_gradients() -> None:
    layer = nn.Linear(3, 2)
    log: list[str] = []
    on_grad_accumulated(list(layer.parameters()), lambda index: log.append(f"grad{index}"))
    out = layer(torch.randn(4, 3))
    seen_in_backward: list[bool] = []
    handle = on_backward_reaching([out, out * 2, torch.zeros(2)], lambda: (log.append("start"),
                                                                           seen_in_backward.append(in_backward())))
    assert handle is not None
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert log[0] == log[3] == "start"
    assert sorted(log[1:3]) == sorted(log[4:]) == ["grad0", "grad1"]
    assert seen_in_backward == [True, True]


def test_on_backward_reaching_skips_tensors_without_grad() -> None:
    assert on_backward_reaching([torch.zeros(2), torch.ones(1)], lambda: None) is None
    assert on_backward_reaching([], lambda: None) is None


def test_removed_backward_reaching_hook_does_not_fire() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    log: list[str] = []
    handle = on_backward_reaching([y], lambda: log.append("start"))
    assert handle is not None
    handle.remove()
    y.sum().backward()
    assert log == []


def test_reentrant_checkpointing_fires_grad_hooks_in_nested_passes() -> None:
    # The outer pass reaches the output first; the checkpointed layer's parameters get their gradients in a
    # nested pass. A callback queued at the start of the outer pass runs after the nested ones: once, at the end.
    inner, outer = nn.Linear(3, 3), nn.Linear(3, 1)
    log: list[str] = []
    on_grad_accumulated([inner.weight], lambda _index: log.append("inner grad"))
    out = outer(checkpoint(inner, torch.randn(2, 3, requires_grad=True), use_reentrant=True))
    on_backward_reaching([out], lambda: at_backward_end(lambda: log.append("end")))
    out.sum().backward()
    assert log == ["inner grad", "end"]
