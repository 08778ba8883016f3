"""Shared FSDP test driver: train a model under fully_shard on thread ranks, and the one-process reference.

The reference runs every rank's shard of the global batch through one model and averages the shard losses, which
is the gradient FSDP must produce (its reduce-scatter averages over ranks). Both sides use SGD with momentum
(AdamW would amplify float noise in gradients that are zero in exact arithmetic, such as a key bias's).

Tolerances: fp32 on CPU, only the order of additions differs: rtol 1e-5 / atol 1e-6, as the DDP parity tests.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from tests.parity.models import batch, build, loss_fn
from tests.parity.test_ddp import count_collectives

TIMEOUT = 60.0
STEPS = 3
LR = 0.1
BATCH_PER_RANK = 2


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules sharded before the root: each GPT block, or each MLP layer."""
    return list(model.blocks) if hasattr(model, "blocks") else list(model.layers)


def shard_blocks_then_root(model: nn.Module, mesh: Any, **options: Any) -> None:
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **{k: v for k, v in options.items() if k != "reshard_after_forward"})


def reference(kind: str, world_size: int, steps: int = STEPS, micro_steps: int = 1,
              build_kwargs: dict[str, Any] | None = None, model: nn.Module | None = None,
              before_step: Callable[[nn.Module], Any] | None = None,
              frozen: Callable[[nn.Module], None] | None = None) -> dict[str, Any]:
    """One process training on the global batch, shard by shard (see the module docstring)."""
    model = model if model is not None else build(kind, seed=0, **(build_kwargs or {}))
    if frozen is not None:
        frozen(model)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses, extras = [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_steps):
            x, y = batch(kind, BATCH_PER_RANK * world_size, seed=step * micro_steps + micro)
            for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True):
                loss = loss_fn(kind, model(xs), ys)
                (loss / (world_size * micro_steps)).backward()
                total += loss.item() / (world_size * micro_steps)
        if before_step is not None:
            extras.append(before_step(model))
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "extras": extras}


def fsdp_train(kind: str, rank: int, world_size: int, *, mesh_shape: tuple[int, ...] | None = None,
               steps: int = STEPS, micro_steps: int = 1, build_kwargs: dict[str, Any] | None = None,
               shard: Callable[[nn.Module, Any], None] = shard_blocks_then_root,
               model: nn.Module | None = None, setup: Callable[[nn.Module], None] | None = None,
               before_step: Callable[[nn.Module], Any] | None = None,
               frozen: Callable[[nn.Module], None] | None = None,
               accumulate_with: str = "set_requires_gradient_sync") -> dict[str, Any]:
    """This rank's FSDP training on its shard of each global batch; counts collectives from step 2 on. With
    micro-steps, the module setter `accumulate_with` is False for all but the last."""
    mesh = init_device_mesh("cpu", mesh_shape or (world_size,))
    model = model if model is not None else build(kind, seed=0, **(build_kwargs or {}))
    if frozen is not None:
        frozen(model)
    shard(model, mesh)
    if setup is not None:
        setup(model)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    groups = {dim: mesh.get_group(dim) for dim in range(mesh.ndim)}
    counts: dict[int, collections.Counter[str]] = {}
    losses, extras, step_counts = [], [], []
    for step in range(steps):
        if step == 1:
            counts = {dim: count_collectives(group) for dim, group in groups.items()}
        before = {dim: dict(c) for dim, c in counts.items()}
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_steps):
            x, y = batch(kind, BATCH_PER_RANK * world_size, seed=step * micro_steps + micro)
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            last = micro == micro_steps - 1
            if micro_steps > 1:
                getattr(model, accumulate_with)(last)
            loss = loss_fn(kind, model(xs), ys)
            (loss / micro_steps).backward()
            total += loss.item() / micro_steps
        if before_step is not None:
            extras.append(before_step(model))
        opt.step()
        losses.append(total)
        if counts:
            step_counts.append({dim: {op: n - before[dim].get(op, 0) for op, n in c.items()}
                                for dim, c in counts.items()})
    with torch.no_grad():
        params = [p.full_tensor() for p in model.parameters()]
    return {"losses": losses, "params": params, "extras": extras, "counts": step_counts, "model": model}


def assert_parity(results: list[dict[str, Any]], ref: dict[str, Any], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Mean rank loss equals the reference loss every step; every rank's full parameters equal the reference's."""
    mean_losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"], dtype=torch.float64), rtol=rtol, atol=atol)
    for result in results:
        assert len(result["params"]) == len(ref["params"])
        for got, want in zip(result["params"], ref["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)

