"""spmd.accumulate: one optimizer step over k micro-batches, every data-parallel module of the model set for each,
with the communication strategy named (see Note: what each strategy sends in src/spmd/accumulation.py). Each
strategy gives the big batch's gradient (one process, the harness's reference), on DDP, FSDP2 and HSDP, and
sends what the Note says it sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import spmd
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.testing import run_ranks
from tests.fsdp.harness import BATCH_PER_RANK, TIMEOUT, assert_parity, optimizer, reference, shard_blocks_then_root
from tests.parity.models import batch, build, loss_fn
from tests.parity.test_ddp import count_collectives

STEPS, MICRO = 2, 3


def _ddp(model: nn.Module, mesh: Any) -> nn.Module:
    return spmd.DistributedDataParallel(model, process_group=mesh.get_group())


def _fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    shard_blocks_then_root(model, mesh)
    return model


def train(rank: int, size: int, wrap: Callable[[nn.Module, Any], nn.Module], reduce: str,
          mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", mesh_shape or (size,))
    model = wrap(build("gpt", seed=0), mesh)
    opt = optimizer(model.parameters())
    counts = [count_collectives(mesh.get_group(dim)) for dim in range(mesh.ndim)]
    losses = []
    for step in range(STEPS):
        micro_batches = [[t.chunk(size)[rank] for t in batch("gpt", BATCH_PER_RANK * size, seed=step * MICRO + m)]
                         for m in range(MICRO)]
        total = 0.0
        for x, y in spmd.accumulate(model, micro_batches, reduce=reduce):
            loss = loss_fn("gpt", model(x), y)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        opt.zero_grad()
        losses.append(total)
    with torch.no_grad():
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "counts": [dict(c) for c in counts]}


@pytest.mark.parametrize("wrap", [_ddp, _fsdp], ids=["ddp", "fsdp"])
def test_last_and_each_give_the_big_batch_gradient_and_each_reduces_every_micro_batch(wrap: Callable) -> None:
    def body(rank: int, size: int) -> tuple[dict, dict]:
        return train(rank, size, wrap, "last"), train(rank, size, wrap, "each")

    results = run_ranks(body, 2, timeout=TIMEOUT)
    ref = reference("gpt", 2, steps=STEPS, micro_steps=MICRO)
    assert_parity([last for last, _ in results], ref)
    assert_parity([each for _, each in results], ref)
    op = "all_reduce" if wrap is _ddp else "reduce_scatter"
    for last, each in results:
        assert last["counts"][0][op] > 0
        assert each["counts"][0][op] == MICRO * last["counts"][0][op]


def test_scatter_each_reduce_scatters_every_micro_batch_and_all_reduces_once_on_hsdp() -> None:
    results = run_ranks(lambda rank, size: train(rank, size, _fsdp, "scatter_each", mesh_shape=(2, 2)), 4,
                        timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 4, steps=STEPS, micro_steps=MICRO))
    groups = len(build("gpt").blocks) + 1
    for result in results:
        replicate, shard = result["counts"]
        assert shard["reduce_scatter"] == STEPS * MICRO * groups
        assert replicate["all_reduce"] == STEPS * groups


def test_what_accumulate_cannot_serve_is_refused_before_anything_runs() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        with pytest.raises(ValueError, match="TinyGPT has no DistributedDataParallel or fully_shard module"):
            next(spmd.accumulate(build("gpt"), [1, 2]))
        with pytest.raises(ValueError, match="reduce must be one of \\['last', 'each', 'scatter_each'\\]"):
            next(spmd.accumulate(build("gpt"), [1], reduce="sometimes"))
        with pytest.raises(ValueError, match=r"'scatter_each' needs HSDP .* under DistributedDataParallel"):
            next(spmd.accumulate(_ddp(build("gpt"), mesh), [1], reduce="scatter_each"))
        with pytest.raises(ValueError, match=r"'scatter_each' needs HSDP .* sharded over a 1-d mesh"):
            next(spmd.accumulate(_fsdp(build("gpt"), mesh), [1], reduce="scatter_each"))
        partly = build("gpt")
        for block in partly.blocks:
            fully_shard(block, mesh=mesh)
        with pytest.raises(ValueError, match=r"outside every data-parallel module, so their gradients would not be "
                                             r"averaged across ranks: position, embed\.weight, ln\.weight, ln\.bias"):
            next(spmd.accumulate(partly, [1]))

    run_ranks(body, 2, timeout=TIMEOUT)


def test_leaving_the_loop_early_leaves_every_module_reducing_again() -> None:
    def body(rank: int, size: int) -> list[bool]:
        mesh = init_device_mesh("cpu", (size,))
        model = _ddp(build("gpt"), mesh)
        for index, _ in enumerate(spmd.accumulate(model, range(3))):
            assert model.require_backward_grad_sync is (index == 2)
            break
        return [model.require_backward_grad_sync]

    assert run_ranks(body, 2, timeout=TIMEOUT) == [[True], [True]]
