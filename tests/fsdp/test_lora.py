"""Frozen parameters beside trainable ones in one fully_shard group, as in LoRA fine-tuning: a frozen base weight
and trainable low-rank adapters. Backward still reads the base weight (for the input's gradient) after the
adapters' gradients are done, so the group must not reshard until backward has passed through the module (see
Note: when a group's backward is over in src/spmd/fsdp/param_group.py). Trains like one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.fsdp.param_group import GroupState
from spmd.testing import run_ranks, seeded
from tests.parity.test_ddp import count_collectives

TIMEOUT = 60.0


class LoRALinear(nn.Module):
    """A frozen base weight and trainable float32 low-rank adapters `a`, `b`."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5, requires_grad=False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.base.to(x.dtype)) + (x @ self.a.T.to(x.dtype)) @ self.b.T.to(x.dtype)


def build() -> nn.Sequential:
    with seeded(0):
        return nn.Sequential(LoRALinear(7, 15), nn.Tanh(), LoRALinear(15, 13), nn.Tanh(), LoRALinear(13, 3))


def batches(world_size: int, steps: int = 3) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2 * world_size, 7, generator=gen) for _ in range(steps)]


def reference(world_size: int, model: nn.Module | None = None) -> tuple[list[float], nn.Module]:
    model = model if model is not None else build()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    losses = []
    for x in batches(world_size):
        loss = torch.stack([model(chunk).square().mean() for chunk in x.chunk(world_size)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def train(rank: int, world_size: int, model: nn.Module | None = None, layers: list[nn.Module] | None = None,
          **options) -> dict:
    """FSDP on each LoRA layer (`layers`, by default every other module), then the root; also records each layer
    group's state when backward reaches the first layer."""
    model = model if model is not None else build()
    mesh = init_device_mesh("cpu", (world_size,))
    layers = layers if layers is not None else list(model[::2])
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    counts = count_collectives(mesh.get_group())
    states: list[list[GroupState]] = []

    def first_layer_reached(grad: Tensor) -> None:
        states.append([layer._fsdp_state().group.state for layer in layers])
    def hook_output(module: nn.Module, args: tuple, out: Tensor) -> None:
        out.register_hook(first_layer_reached)
    layers[0].register_forward_hook(hook_output)
    losses = []
    for x in batches(world_size):
        loss = model(x.chunk(world_size)[rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    step_counts = dict(counts)
    with torch.no_grad():
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "counts": step_counts, "states": states, "model": model}


def assert_matches(results: list[dict], losses: list[float], ref: nn.Module) -> None:
    mean = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(losses, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    for result in results:
        for name, want in ref.named_parameters():
            got = result["params"][name]
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_lora_layers_train_like_one_process_and_reshard_once_backward_has_passed(world_size: int) -> None:
    losses, ref = reference(world_size)
    results = run_ranks(lambda rank, size: train(rank, size), world_size, timeout=TIMEOUT)
    assert_matches(results, losses, ref)
    for result in results:
        # the later layers were resharded during backward, before it reached the first one
        assert [states[1:] for states in result["states"]] == [[GroupState.SHARDED, GroupState.SHARDED]] * 3
        assert result["counts"]["reduce_scatter"] == 3 * 3


class _Reentrant(nn.Module):
    """Runs `inner` under reentrant activation checkpointing: its forward runs with grad disabled, and again in
    backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)


def test_lora_layers_under_reentrant_checkpointing_wait_for_the_end_of_backward() -> None:
    def model() -> nn.Sequential:
        layers = build()
        layers[2], layers[4] = _Reentrant(layers[2]), _Reentrant(layers[4])
        return layers

    losses, ref = reference(2, model())

    def body(rank: int, size: int) -> dict:
        layers = model()
        return train(rank, size, model=layers, layers=[layers[0], layers[2].inner, layers[4].inner])

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_matches(results, losses, ref)
    for result in results:    # the checkpointed layers gave no sign: resharded at the end of backward
        assert [states[1:] for states in result["states"]] == [[GroupState.UNSHARDED, GroupState.UNSHARDED]] * 3
