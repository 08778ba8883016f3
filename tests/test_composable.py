"""torch's composable APIs at `spmd._composable`: `replicate` (DDP applied by hooks, as TorchTitan's apply_ddp
calls it), `checkpoint` (activation checkpointing by hooks) and `contract`. The module keeps its class's behaviour
and its parameter names; replicate trains like one process and like DistributedDataParallel."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import spmd
from spmd._composable import _get_registry, checkpoint, contract, replicate
from spmd._composable.contract import _State
from spmd.ddp import allreduce_hook
from spmd.fsdp import fully_shard
from spmd.testing import run_ranks, seeded
from tests.parity.models import batch, build, loss_fn
from tests.parity.test_ddp import count_collectives

TIMEOUT = 60.0
STEPS = 3


def reference(kind: str, world_size: int, micro_steps: int = 1) -> dict:
    """One process on the global batch, each rank's shard's loss averaged (as DDP's gradient)."""
    model = build(kind, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_steps):
            x, y = batch(kind, 2 * world_size, seed=step * micro_steps + micro)
            for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True):
                loss = loss_fn(kind, model(xs), ys) / (world_size * micro_steps)
                loss.backward()
                total += loss.item()
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": dict(model.named_parameters())}


def train(rank: int, world_size: int, kind: str, micro_steps: int = 1, **options: object) -> dict:
    model = replicate(build(kind, seed=0), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counts = None
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_steps):
            model.set_requires_gradient_sync(micro == micro_steps - 1)
            x, y = batch(kind, 2 * world_size, seed=step * micro_steps + micro)
            loss = loss_fn(kind, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]) / micro_steps
            loss.backward()
            total += loss.item()
            if counts is None:      # the DDP exists after the first forward
                counts = count_collectives(replicate.state(model)._ddp.process_group)
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "model": model, "counts": dict(counts or {})}


def assert_parity(results: list[dict], ref: dict) -> None:
    mean = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=1e-6)
    for result in results:
        assert result["params"].keys() == ref["params"].keys()      # no `module.` prefix
        for name, param in ref["params"].items():
            torch.testing.assert_close(result["params"][name], param.detach(), rtol=1e-5, atol=1e-6)


# -- replicate (DDP by hooks) ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_replicate_trains_like_one_process_and_keeps_names_and_class(kind: str) -> None:
    results = run_ranks(lambda rank, size: train(rank, size, kind, bucket_cap_mb=0.001), 2, timeout=TIMEOUT)
    assert_parity(results, reference(kind, 2))
    for result in results:
        model = result["model"]
        assert type(model).__name__ == f"DDP{type(build(kind)).__name__}"
        assert isinstance(model, type(build(kind)))
        assert set(_get_registry(model)) == {"replicate"}
        assert result["counts"]["all_reduce"] > 1        # small buckets: several all-reduces per backward


def test_replicate_accumulates_without_sync() -> None:
    results = run_ranks(lambda rank, size: train(rank, size, "mlp", micro_steps=2), 2, timeout=TIMEOUT)
    assert_parity(results, reference("mlp", 2, micro_steps=2))
    for result in results:       # counted from the first micro-step on: one bucket, one all-reduce per step
        assert result["counts"]["all_reduce"] == STEPS


@pytest.mark.parametrize("mode", ["last", "each"])
def test_accumulate_drives_replicate_and_refuses_its_ignored_modules(mode: str) -> None:
    def inputs() -> list[Tensor]:
        return [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def build_model() -> nn.Module:
        with seeded(0):
            return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))

    def body(rank: int, size: int) -> list[Tensor]:
        model = replicate(build_model())
        counts = None
        for x in spmd.accumulate(model, [x.chunk(size)[rank] for x in inputs()], reduce=mode):
            (model(x).square().mean() / 3).backward()
            counts = counts if counts is not None else count_collectives(replicate.state(model)._ddp.process_group)
        with pytest.raises(ValueError, match=r"outside every data-parallel module, .*: 2\.weight, 2\.bias"):
            holdout = build_model()
            replicate(holdout, ignored_modules=[holdout[2]])
            next(iter(spmd.accumulate(holdout, [1])))
        assert counts["all_reduce"] == (2 if mode == "each" else 1)     # counted from the first micro-batch on
        return [p.grad for p in model.parameters()]

    model = build_model()
    (sum(model(x).square().mean() for x in inputs()) / 3).backward()
    for grads in run_ranks(body, 2, timeout=TIMEOUT):
        for got, param in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, param.grad)


def test_replicate_comm_hook_registered_before_the_first_forward_runs() -> None:
    def body(rank: int, size: int) -> int:
        calls = []

        def hook(state: object, bucket: object):
            calls.append(1)
            return allreduce_hook(state, bucket)

        with seeded(0):
            model = replicate(nn.Linear(3, 2))
        model.register_comm_hook(None, hook)
        model(torch.randn(2, 3)).sum().backward()
        return len(calls)

    assert run_ranks(body, 2, timeout=TIMEOUT) == [1, 1]


def test_replicate_leaves_ignored_and_fully_sharded_modules_to_themselves() -> None:
    """An ignored module's gradients stay this rank's; a fully_shard submodule reduces its own."""

    def body(rank: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
        with seeded(0):
            model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
        fully_shard(model[1])
        replicate(model, ignored_modules=[model[2]])
        model(torch.full((1, 3), float(rank + 1))).sum().backward()
        return model[0].weight.grad, model[1].weight.grad.full_tensor(), model[2].weight.grad

    (first0, sharded0, ignored0), (first1, sharded1, ignored1) = run_ranks(body, 2, timeout=TIMEOUT)
    torch.testing.assert_close(first0, first1)
    torch.testing.assert_close(sharded0, sharded1)
    assert not torch.allclose(ignored0, ignored1)


def test_replicate_refuses_what_it_cannot_do() -> None:
    def body(rank: int, size: int) -> None:
        with pytest.raises(RuntimeError, match="device_id must be an int or a torch"):
            replicate(nn.Linear(2, 2), device_id="cuda:0")
        with pytest.raises(RuntimeError, match="already managed by fully_shard"):
            replicate(fully_shard(nn.Linear(2, 2)))
        model = replicate(nn.Linear(2, 2), device_id=torch.device("cpu"))
        with pytest.raises(RuntimeError, match="already replicated"):
            replicate(model)
        with pytest.raises(AssertionError, match="can't be deep-copied"):
            copy.deepcopy(model)

    run_ranks(body, 2, timeout=TIMEOUT)


# -- checkpoint (activation checkpointing by hooks) ----------------------------------------------------------

class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x))


def _saved_count(model: nn.Module, x: Tensor) -> tuple[int, Tensor]:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(x).sum()
    return len(saved), loss


def test_checkpoint_saves_less_and_gives_the_same_gradients_dropout_included() -> None:
    with seeded(0):
        plain = Stack()
    checkpointed = copy.deepcopy(plain)
    checkpoint(checkpointed.inner)
    x = torch.randn(8, 4)
    with seeded(5):
        plain_saved, plain_loss = _saved_count(plain, x)
    with seeded(5):
        ours_saved, ours_loss = _saved_count(checkpointed, x)
    plain_loss.backward()
    ours_loss.backward()
    assert ours_saved < plain_saved
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for ours, theirs in zip(checkpointed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)    # the recomputed dropout mask too
    assert set(_get_registry(checkpointed.inner)) == {"checkpoint"}


def test_checkpoint_refuses_reentrant_and_unknown_options_and_a_second_application() -> None:
    with pytest.raises(NotImplementedError, match="use_reentrant=True"):
        checkpoint(nn.Linear(2, 2), use_reentrant=True)
    with pytest.raises(ValueError, match="unexpected keyword arguments"):
        checkpoint(nn.Linear(2, 2), preserve=True)
    layer = checkpoint(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="already applied"):
        checkpoint(layer)


# -- contract -------------------------------------------------------------------------------------------------

def test_contract_attaches_state_records_the_api_and_guards_the_module() -> None:
    class Counter(_State):
        def __init__(self) -> None:
            self.calls = 0

    @contract(Counter)
    def count_forwards(module: nn.Module) -> nn.Module:
        module.register_forward_pre_hook(lambda m, args: setattr(count_forwards.state(m), "calls",
                                                                 count_forwards.state(m).calls + 1))
        return module

    @contract()
    def swaps(module: nn.Module) -> nn.Module:
        return nn.Linear(1, 1)

    layer = count_forwards(nn.Linear(2, 2))
    layer(torch.randn(1, 2))
    layer(torch.randn(1, 2))
    assert count_forwards.state(layer).calls == 2
    assert set(_get_registry(layer)) == {"count_forwards"}
    with pytest.raises(RuntimeError, match="must return the module it was given"):
        swaps(nn.Linear(2, 2))
