"""The generic Join protocol, as torch's tutorial uses it ("Distributed Training with Uneven Inputs Using the
Join Context Manager"): the tutorial's own Joinable (a counter with a join hook and a post hook), DDP with
ZeroRedundancyOptimizer under `Join([model, optim])` matching one process that trains every rank's batches,
throw_on_early_termination on every rank, and the set-ups Join refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import spmd
from spmd.algorithms.join import Join, Joinable, JoinHook
from spmd.optim import ZeroRedundancyOptimizer
from spmd.testing import run_ranks
from tests.parity.models import batch, build, loss_fn


class CounterJoinHook(JoinHook):
    def __init__(self, counter: Counter, sync_max_count: bool) -> None:
        self.counter = counter
        self.sync_max_count = sync_max_count

    def main_hook(self) -> None:
        spmd.all_reduce(torch.zeros(1, device=self.counter.device))       # shadow the counter's all_reduce

    def post_hook(self, is_last_joiner: bool) -> None:
        if not self.sync_max_count:
            return
        common = torch.tensor([spmd.get_rank() if is_last_joiner else -1])
        spmd.all_reduce(common, op=spmd.ReduceOp.MAX)
        if spmd.get_rank() == int(common):
            self.counter.max_count = self.counter.count.detach().clone()
        spmd.broadcast(self.counter.max_count, src=int(common))


class Counter(Joinable):
    """The tutorial's example: counts, over all ranks, the inputs processed."""

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.count = torch.zeros(1)
        self.max_count = torch.zeros(1)

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = torch.ones(1)
        spmd.all_reduce(t)
        self.count += t

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterJoinHook(self, kwargs.get("sync_max_count", False))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return spmd.group.WORLD


def test_the_tutorials_counter_counts_every_rank_and_syncs_the_max() -> None:
    def body(rank: int, size: int) -> tuple[float, float]:
        counter = Counter()
        with Join([counter], sync_max_count=True):
            for _ in range(5 + rank):
                counter()
        counter()                                  # outside the block: a plain all_reduce again
        return counter.count.item(), counter.max_count.item()

    # 5 iterations counting both ranks, a 6th counting rank 1 alone (rank 0 shadows it), then one with both
    assert run_ranks(body, 2, timeout=60) == [(2 * 5 + 2, 11.0), (2 * 5 + 1 + 2, 11.0)]


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_ddp_and_zero_under_join_train_as_one_process(divide_by_initial_world_size: bool) -> None:
    steps_of = {0: 2, 1: 4, 2: 3}

    def body(rank: int, size: int) -> list[torch.Tensor]:
        model = spmd.DistributedDataParallel(build("mlp", seed=0))
        optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        with Join([model, optim], divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(steps_of[rank]):
                x, y = batch("mlp", 4 * size, seed=step)
                loss_fn("mlp", model(x.chunk(size)[rank]), y.chunk(size)[rank]).backward()
                optim.step()
                optim.zero_grad()
        return [p.detach().clone() for p in model.module.parameters()]

    results = run_ranks(body, 3, timeout=60)
    model = build("mlp", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(steps_of.values())):
        active = [r for r in range(3) if step < steps_of[r]]
        divisor = 3 if divide_by_initial_world_size else len(active)
        x, y = batch("mlp", 12, seed=step)
        for rank in active:
            (loss_fn("mlp", model(x.chunk(3)[rank]), y.chunk(3)[rank]) / divisor).backward()
        opt.step()
        opt.zero_grad()
    for params in results:
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    def body(rank: int, size: int) -> str:
        counter = Counter()
        with pytest.raises(RuntimeError, match=r"ran out of inputs") as info, \
                Join([counter], throw_on_early_termination=True):
            for _ in range(1 + rank):
                counter()
        return str(info.value)

    messages = run_ranks(body, 3, timeout=60)
    assert "this rank ran out of inputs before 2 other(s)" in messages[0]
    assert all("1 rank(s) ran out of inputs before the others" in m for m in messages[1:]), messages


def test_bad_set_ups_are_refused() -> None:
    class Forgetful(Counter):
        def __init__(self) -> None:       # never calls Joinable.__init__
            self.device = torch.device("cpu")

    def body(rank: int, size: int) -> None:
        with pytest.raises(ValueError, match=r"at least one joinable"):
            Join([])
        with pytest.raises(TypeError, match=r"\['Forgetful'\] did not call Joinable.__init__"):
            Join([Forgetful()])
        pair = spmd.new_group([0, 1])
        model = spmd.DistributedDataParallel(build("mlp", seed=0), process_group=pair)
        with pytest.raises(ValueError, match=r"communicate over different groups"):
            Join([model, Counter()])
        counter = Counter()
        with Join([counter]), pytest.raises(RuntimeError, match=r"\['Counter'\] already inside a join context"):
            with Join([counter]):
                pass

    run_ranks(body, 2, timeout=60)
