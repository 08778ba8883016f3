"""ShardedGradScaler: ranks with different gradients agree on skipping a step when any rank's gradients hold an
inf (torch.amp.GradScaler alone lets the other ranks step), scale like GradScaler when none does, and work
on FSDP's DTensor gradients and on a rank without gradients."""

from __future__ import annotations

import torch
from torch import nn

from spmd.fsdp import fully_shard
from spmd.fsdp.sharded_grad_scaler import ShardedGradScaler
from spmd.testing import run_ranks
from tests.parity.models import build

TIMEOUT = 60


def _stage(rank: int) -> nn.Linear:
    """A different layer per rank, as pipeline stages hold."""
    generator = torch.Generator().manual_seed(rank)
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2, 3, generator=generator))
        layer.bias.zero_()
    return layer


def _step(layer: nn.Linear, scaler: torch.amp.GradScaler, poison: bool) -> tuple[bool, float]:
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    loss = layer(torch.ones(1, 3)).sum() * (float("inf") if poison else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return not torch.equal(before, layer.weight), scaler.get_scale()


def test_an_inf_on_one_rank_skips_the_step_on_every_rank() -> None:
    def body(rank: int, size: int) -> dict:
        sharded = _step(_stage(rank), ShardedGradScaler("cpu", init_scale=4.0), poison=rank == 1)
        plain = _step(_stage(rank), torch.amp.GradScaler("cpu", init_scale=4.0), poison=rank == 1)
        clean = _step(_stage(rank), ShardedGradScaler("cpu", init_scale=4.0, growth_interval=1), poison=False)
        return {"sharded": sharded, "plain": plain, "clean": clean}

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert [r["sharded"] for r in results] == [(False, 2.0), (False, 2.0)]       # both skip, both back off
    assert [r["plain"] for r in results] == [(True, 4.0), (False, 2.0)]          # GradScaler alone: they diverge
    assert [r["clean"] for r in results] == [(True, 8.0), (True, 8.0)]


def test_the_steps_it_takes_are_gradscalers() -> None:
    want = _stage(0)
    _step(want, torch.amp.GradScaler("cpu", init_scale=8.0), poison=False)

    def body(rank: int, size: int) -> torch.Tensor:
        layer = _stage(0)
        _step(layer, ShardedGradScaler("cpu", init_scale=8.0), poison=False)
        return layer.weight.detach()

    for got in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(got, want.weight.detach(), rtol=0, atol=0)


def test_fsdp_gradients_and_a_rank_without_gradients() -> None:
    def body(rank: int, size: int) -> tuple[bool, float, float]:
        from spmd.device_mesh import init_device_mesh

        model = build("mlp", seed=0)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        scaler = ShardedGradScaler("cpu", init_scale=4.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 7) * (float("nan") if rank == 0 else 1.0)
        scaler.scale(model(x).sum()).backward()
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(), strict=True))
        idle = nn.Linear(2, 2)                 # this rank's optimizer has no gradients at all
        idle_scaler = ShardedGradScaler("cpu", init_scale=4.0)
        idle_opt = torch.optim.SGD(idle.parameters(), lr=0.1)
        if rank == 1:
            idle_scaler.scale(idle(torch.full((1, 2), float("inf"))).sum()).backward()
        else:
            idle_scaler.scale(torch.ones(()))
        idle_scaler.step(idle_opt)
        idle_scaler.update()
        return stepped, scaler.get_scale(), idle_scaler.get_scale()

    assert run_ranks(body, 2, timeout=TIMEOUT) == [(False, 2.0, 2.0), (False, 2.0, 2.0)]
