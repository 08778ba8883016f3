"""torch.amp.GradScaler and torch.nn.utils.clip_grad_norm_ on sharded DTensor parameters and gradients.

The layouts are FSDP2's: every parameter Shard(0) on a 1-d mesh, (Replicate(), Shard(0)) on a 2x2 mesh (HSDP),
with dim-0 sizes that don't divide by the ranks (5 rows over 2 and 4) and shards that are empty (2 rows over
4 ranks, 1 row over 2). Each result is compared with the same code on plain tensors in one process, and an
inf or NaN on a single rank's shard must stop the optimizer step on every rank.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from spmd.tensor.ops import foreach as foreach_ops
from spmd.testing import run_ranks
from spmd.testing.dtensor import make_dtensor
from tests.tensor.conftest import run_on_mesh
from tests.tensor.rule_checks import checking_fallbacks

MESHES = [(2,), (4,), (2, 2)]
SHAPES = [(5, 3), (5,), (2, 5)]          # up.weight, up.bias, down.weight: 5 rows over 2 and 4; 2 rows over 4
STEPS = 3
TOL = 1e-5


def _fsdp_layout(mesh: DeviceMesh) -> tuple[Placement, ...]:
    """FSDP2's parameter layout: Shard(0), replicated over a leading HSDP mesh dim."""
    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


def _data(seed: int = 0) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
    """The full initial parameters and STEPS batches (x, y), from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator) for shape in SHAPES]
    batches = [(torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(STEPS)]
    return params, batches


def _loss(params: Sequence[Tensor], x: Tensor, y: Tensor) -> Tensor:
    up, bias, down = params
    return ((F.linear(torch.tanh(F.linear(x, up, bias)), down) - y) ** 2).mean()


def _scaler() -> torch.amp.GradScaler:
    # growth_interval=2: the scale grows after step 2, so update() is checked on a changing scale too
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)


def _train(params: list[Tensor], batches: list[tuple[Tensor, Tensor]], as_input: Any,
           optimizer_options: dict[str, Any]) -> tuple[list[float], float]:
    """STEPS scaled steps of Adam; the losses and the final scale."""
    optimizer = torch.optim.Adam(params, lr=0.05, **optimizer_options)
    scaler = _scaler()
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = _loss(params, as_input(x), as_input(y))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
    return losses, scaler.get_scale()


@pytest.mark.parametrize("optimizer_options", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_grad_scaler_training_matches_one_process(mesh_shape: tuple[int, ...],
                                                  optimizer_options: dict[str, Any]) -> None:
    fulls, batches = _data()
    plain = [torch.nn.Parameter(t.clone()) for t in fulls]
    want_losses, want_scale = _train(plain, batches, lambda t: t, optimizer_options)

    def body(mesh: DeviceMesh) -> None:
        layout = _fsdp_layout(mesh)
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, layout)) for t in fulls]
        losses, scale = _train(params, batches, lambda t: distribute_tensor(t, mesh, [Replicate()] * mesh.ndim),
                               optimizer_options)
        torch.testing.assert_close(losses, want_losses, rtol=TOL, atol=TOL)
        assert scale == want_scale == 2.0 ** 11
        for k, (got, want) in enumerate(zip(params, plain)):
            assert got.placements == layout
            torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=TOL, atol=TOL,
                                       msg=lambda m, k=k: f"parameter {k}: {m}")
    run_on_mesh(mesh_shape, body)


def _break_one_rank(params: Sequence[DTensor], rank: int, value: float) -> None:
    """Write `value` into the first element of the first non-empty local gradient shard, on `rank` only."""
    if params[0].device_mesh.get_rank() != rank:
        return
    local = next(p.grad.to_local() for p in params if p.grad.to_local().numel())
    local.view(-1)[0] = value


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(mesh_shape: tuple[int, ...],
                                                                      value: float) -> None:
    """Rank 1's shard goes bad. On the 2x2 mesh ranks 2 and 3 hold replicas of rank 0 and 1's shards: had
    found_inf been reduced over the sharded mesh dim only, they would step."""
    fulls, batches = _data()
    x, y = batches[0]

    def body(mesh: DeviceMesh) -> float:
        replicate = [Replicate()] * mesh.ndim
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, _fsdp_layout(mesh))) for t in fulls]
        optimizer = torch.optim.SGD(params, lr=0.1, foreach=True)
        scaler = _scaler()
        before = [p.to_local().clone() for p in params]
        loss = _loss(params, distribute_tensor(x, mesh, replicate), distribute_tensor(y, mesh, replicate))
        scaler.scale(loss).backward()
        with torch.no_grad():
            _break_one_rank(params, 1, value)
        scaler.step(optimizer)
        scaler.update()
        for k, (p, old) in enumerate(zip(params, before)):
            assert torch.equal(p.to_local(), old), f"rank {mesh.get_rank()} stepped parameter {k}"
        return scaler.get_scale()
    # A rank that steps alone waits in the step's collectives for ranks that skipped it: a short timeout fails
    # that fast. The scale backed off once, on every rank.
    assert run_on_mesh(mesh_shape, body, timeout=15.0) == [2.0 ** 9] * math.prod(mesh_shape)


def _unscale(grads: list[Tensor], inv_scale: float) -> Tensor:
    found_inf = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((), inv_scale))
    return found_inf


def test_unscale_keeps_each_layout_and_reduces_found_inf_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any gradient layout is unscaled where it lies (a Partial one reduced first), with ONE all-reduce of
    found_inf per call on the 2x2 mesh over the whole world."""
    calls: list[str] = []
    original = foreach_ops.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(foreach_ops, "all_reduce", counting)
    generator = torch.Generator().manual_seed(1)
    fulls = [torch.randn(shape, generator=generator) for shape in [(5, 3), (1, 4), (6,), (3, 2)]]

    def body(mesh: DeviceMesh) -> None:
        layouts = [(Replicate(), Shard(0)), (Shard(0), Shard(0)), (Partial(), Replicate()), (Shard(1), Replicate())]
        grads = [make_dtensor(t, mesh, layout) for t, layout in zip(fulls, layouts)]
        assert _unscale(grads, 0.25).item() == 0.0
        for grad, full, layout in zip(grads, fulls, layouts):
            assert grad.placements == tuple(Replicate() if p.is_partial() else p for p in layout)
            torch.testing.assert_close(grad.full_tensor(), full * 0.25)
    run_on_mesh((2, 2), body)
    assert sorted(calls) == [f"spmd-rank{r}" for r in range(4)]


def test_partial_gradient_is_checked_after_its_reduction() -> None:
    """Every rank's term is finite, their sum overflows float32: the step must be skipped."""
    def body(mesh: DeviceMesh) -> None:
        grad = DTensor.from_local(torch.full((3,), 3e38), mesh, [Partial()])
        assert _unscale([grad], 1.0).item() == 1.0
        assert grad.placements == (Replicate(),) and torch.isinf(grad.to_local()).all()
    run_on_mesh((2,), body)


def test_found_inf_on_a_sub_mesh_is_reduced_per_mesh_dim() -> None:
    """A 2x2 sub-mesh of 8 ranks has no group of its own: found_inf is reduced over each of its mesh dims."""
    def rank_body(rank: int, world_size: int) -> float:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "shard"))["dp", "shard"]
        assert mesh.existing_group() is None
        grad = distribute_tensor(torch.arange(5.0), mesh, [Replicate(), Shard(0)])
        if rank == 7:
            grad.to_local()[0] = math.inf
        return checking_fallbacks(lambda: _unscale([grad], 0.5).item())
    assert run_ranks(rank_body, world_size=8, timeout=60.0) == [0.0] * 4 + [1.0] * 4


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single_tensor"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_clip_grad_norm_matches_one_process(mesh_shape: tuple[int, ...], norm_type: float, foreach: bool) -> None:
    """Sharded gradients, one with an empty shard on every mesh (a single row), are clipped as in one process."""
    generator = torch.Generator().manual_seed(2)
    shapes = [*SHAPES, (1, 3)]
    fulls = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) * (k + 1) for k, shape in enumerate(shapes)]
    plain = [torch.nn.Parameter(t.clone()) for t in fulls]
    for p, g in zip(plain, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(plain, 1.0, norm_type, foreach=foreach)
    assert want > 1.0      # the gradients are clipped

    def body(mesh: DeviceMesh) -> None:
        layout = _fsdp_layout(mesh)
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, layout)) for t in fulls]
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g, mesh, layout)
        assert params[-1].grad.to_local().numel() == 0 or mesh.get_local_rank(mesh.ndim - 1) == 0
        got = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=foreach)
        assert isinstance(got, DTensor) and got.placements == (Replicate(),) * mesh.ndim
        torch.testing.assert_close(got.full_tensor(), want, rtol=TOL, atol=TOL)
        for k, (p, q) in enumerate(zip(params, plain)):
            assert p.grad.placements == layout
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=TOL, atol=TOL,
                                       msg=lambda m, k=k: f"gradient {k}: {m}")
    run_on_mesh(mesh_shape, body)
