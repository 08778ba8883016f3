"""DDP with a user's own communication hook (the GradBucket interface), and with `broadcast_buffers=False`.

A custom hook sees every bucket once per step, in launch order, with the bucket's parameters and a gradient
buffer it must reduce itself; the model must then train exactly like one process (same tolerances as
test_ddp.py: fp32 on CPU, only the order of additions differs).
"""

from __future__ import annotations

import torch

import spmd
from spmd.ddp.bucket import GradBucket
from spmd.testing import run_ranks
from tests.parity.models import build
from tests.parity.test_ddp import STEPS, TIMEOUT, assert_parity, ddp_train, reference


class RecordingSumThenDivideHook:
    """A hook written against GradBucket alone: SUM all-reduce, then divide in the future's callback."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, int, int]] = []   # (index, is_last, numel, parameter count)
        self.members: dict[int, list[int]] = {}              # bucket index -> id() of its parameters

    def __call__(self, state: object, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        assert sum(g.numel() for g in bucket.gradients()) == buffer.numel()
        assert all(g.data_ptr() >= buffer.data_ptr() for g in bucket.gradients())   # views into the buffer
        self.calls.append((bucket.index(), bucket.is_last(), buffer.numel(), len(bucket.parameters())))
        self.members[bucket.index()] = [id(p) for p in bucket.parameters()]
        work = spmd.all_reduce(buffer, group=bucket.process_group(), async_op=True)
        div_factor = bucket.div_factor()
        return work.get_future().then(lambda future: future.value()[0].div_(div_factor))


def test_a_custom_hook_sees_each_bucket_once_per_step_and_trains_like_one_process() -> None:
    hooks: dict[int, RecordingSumThenDivideHook] = {}

    def body(rank: int, size: int) -> dict:
        hooks[rank] = RecordingSumThenDivideHook()
        return ddp_train("gpt", rank, size, bucket_cap_mb=0.01,
                         setup=lambda model: model.register_comm_hook(None, hooks[rank]))

    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert_parity(results, reference("gpt", 2))
    for rank, result in enumerate(results):
        calls, buckets = hooks[rank].calls, result["buckets"]
        assert result["counts"] == {"all_reduce": STEPS * buckets}
        per_step = [calls[step * buckets:(step + 1) * buckets] for step in range(STEPS)]
        assert all(step == per_step[0] for step in per_step)                 # same buckets every step
        assert sorted(index for index, *_ in per_step[0]) == list(range(buckets))
        assert [is_last for _, is_last, *_ in per_step[0]] == [False] * (buckets - 1) + [True]
        params = list(result["model"].module.parameters())
        owned = [pid for members in hooks[rank].members.values() for pid in members]
        assert sorted(owned) == sorted(id(p) for p in params)               # every parameter in one bucket
    assert hooks[0].calls == hooks[1].calls                                  # the ranks agree on the buckets


def test_without_broadcast_buffers_each_rank_keeps_its_own_buffers() -> None:
    def body(rank: int, size: int) -> tuple[float, bool]:
        model = spmd.DistributedDataParallel(build("cnn"), broadcast_buffers=False)
        model.eval()
        model.module.norm.running_mean.fill_(float(rank + 1))
        model(torch.randn(2, 3, 9, 9)).sum().backward()           # gradients still averaged...
        grad = next(model.module.parameters()).grad
        assert grad is not None
        gathered = [torch.empty_like(grad) for _ in range(size)]
        spmd.all_gather(gathered, grad)
        return model.module.norm.running_mean[0].item(), torch.equal(gathered[0], gathered[1])

    assert run_ranks(body, 2, timeout=TIMEOUT) == [(1.0, True), (2.0, True)]   # ...buffers left alone
