"""Arguments that can't be right fail at once with a message that names the rank and says what would be right:
complex reductions other than SUM/AVG (spmd moves complex as pairs of reals, so MAX, MIN and PRODUCT would
return numbers that are neither input nor product), impossible ranks and world sizes before any rendezvous
waits on them, and a root outside the group, naming the caller."""

from __future__ import annotations

import time

import pytest
import torch

import spmd
from spmd import ReduceOp
from spmd.testing import run_ranks


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT])
def test_complex_reductions_other_than_sum_and_avg_raise_before_sending(op: ReduceOp) -> None:
    def body(rank: int, world_size: int) -> list:
        t = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
        with pytest.raises(ValueError, match=f"on rank {rank} .*not defined for complex tensors"):
            spmd.all_reduce(t, op=op)
        with pytest.raises(ValueError, match="not defined for complex"):
            spmd.reduce_scatter_tensor(torch.empty(1, dtype=t.dtype), t, op=op)
        avg = t.clone()
        spmd.all_reduce(t)                       # SUM and AVG stay exact on pairs of reals
        spmd.all_reduce(avg, op=ReduceOp.AVG)
        return [t.tolist(), avg.tolist()]

    results = run_ranks(body, world_size=2, timeout=30)
    want = (torch.tensor([1 + 2j, 3 - 1j]) * 3).tolist()
    assert results == [[want, (torch.tensor([1 + 2j, 3 - 1j]) * 1.5).tolist()]] * 2


@pytest.mark.parametrize(("rank", "world_size", "message"), [
    (2, 2, r"rank=2 is out of range for world_size=2: ranks are 0..1"),
    (0, 0, r"world_size=0: it must be a positive number of ranks"),
    (-3, 2, r"rank=-3: ranks count from 0"),
])
def test_impossible_ranks_fail_before_the_rendezvous(rank: int, world_size: int, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        spmd.init_process_group("tcp", init_method="tcp://127.0.0.1:1", rank=rank, world_size=world_size,
                                timeout=30)
    assert time.monotonic() - started < 5.0      # nothing waited on a store that will never answer
    assert not spmd.is_initialized()


def test_a_root_outside_the_group_names_the_calling_rank() -> None:
    def body(rank: int, world_size: int) -> str:
        pair = spmd.new_group([0, 1])
        if rank > 1:
            return ""
        with pytest.raises(ValueError) as raised:
            spmd.broadcast(torch.zeros(2), src=2, group=pair)
        return str(raised.value)

    for rank, message in enumerate(run_ranks(body, world_size=3, timeout=30)[:2]):
        assert f"broadcast on rank {rank} of group" in message and "src: rank 2 is not in group" in message, message
