"""shrink_group: the ranks that remain make a group without the excluded ones, whether those left or died.

Shrinking the world renumbers the remaining ranks in order (as torch's does), destroys every other group and
leaves a default group that the collectives, new groups and torch's own default group (over the "spmd" backend)
all see; shrinking a subgroup leaves the world alone. A rank killed in a real process: the survivors' collective
fails with PeerLostError, they shrink the world past it, and train on. Bad arguments fail on the calling rank,
naming it, before anything changes.
"""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd._core.errors import GroupAbortedError, PeerLostError
from spmd.distributed_c10d import SHRINK_ABORT
from spmd.testing import run_ranks
from tests.procpool import ProcPool, kill_self


def test_shrinking_the_world_renumbers_the_ranks_left_and_destroys_the_other_groups() -> None:
    def body(rank: int, size: int) -> dict | None:
        everyone = spmd.new_group([0, 1, 2, 3])
        if rank == 1:
            return None                            # leaves: the others shrink without it
        group = spmd.shrink_group([1])
        new_rank = spmd.get_rank()
        spmd.all_reduce(t := torch.tensor([float(new_rank)]))
        pair = spmd.new_group([0, 2])
        if new_rank in (0, 2):
            spmd.all_reduce(p := torch.ones(1), group=pair)
        with pytest.raises(RuntimeError, match=r"the group was destroyed"):
            spmd.all_reduce(torch.ones(1), group=everyone)
        return {"rank": new_rank, "size": spmd.get_world_size(), "sum": t.item(), "ranks": group.ranks,
                "default": spmd.group.WORLD is group, "pair": p.item() if new_rank in (0, 2) else None}

    results = run_ranks(body, 4, timeout=60)
    assert results[1] is None
    assert [r["rank"] for r in (results[0], results[2], results[3])] == [0, 1, 2]
    for result in (results[0], results[2], results[3]):
        assert result["size"] == 3 and result["sum"] == 3.0 and result["ranks"] == [0, 1, 2] and result["default"]
    assert results[0]["pair"] == results[3]["pair"] == 2.0


def test_shrinking_a_subgroup_leaves_the_world_alone() -> None:
    def body(rank: int, size: int) -> list | None:
        sub = spmd.new_group([1, 2, 3])
        if rank in (0, 1):
            spmd.barrier()
            return None
        shrunk = spmd.shrink_group([0], group=sub)          # group rank 0 of sub: global rank 1
        spmd.all_reduce(t := torch.tensor([float(rank)]), group=shrunk)
        with pytest.raises(RuntimeError, match=r"the group was destroyed"):
            spmd.all_reduce(torch.ones(1), group=sub)
        spmd.barrier()                                      # the world still has all four ranks
        return [shrunk.ranks, spmd.get_rank(), spmd.get_world_size(), t.item()]

    results = run_ranks(body, 4, timeout=60)
    assert results[2] == [[2, 3], 2, 4, 5.0] and results[3] == [[2, 3], 3, 4, 5.0]


def test_shrink_abort_fails_what_the_old_group_still_had_queued() -> None:
    def body(rank: int, size: int) -> str | None:
        if rank == 2:
            return None
        work = spmd.all_reduce(torch.ones(1), async_op=True)     # waits for rank 2, which never comes
        spmd.shrink_group([2], shrink_flags=SHRINK_ABORT)
        with pytest.raises(GroupAbortedError) as info:
            work.wait()
        spmd.all_reduce(t := torch.ones(1))
        assert t.item() == 2.0
        return str(info.value)

    results = run_ranks(body, 3, timeout=60)
    assert results[2] is None
    assert all("SHRINK_ABORT" in message for message in results[:2]), results


@pytest.mark.parametrize("args, kwargs, error, says", [
    (([1],), {}, RuntimeError, r"this rank \(group rank 1 of 'default'\) is in ranks_to_exclude \[1\]"),
    (([],), {}, ValueError, r"ranks_to_exclude must be a non-empty list"),
    (([3],), {}, ValueError, r"ranks_to_exclude \[3\] hold \[3\], not group ranks of 'default' \(0..2\)"),
    (([2, 2],), {}, ValueError, r"ranks_to_exclude \[2, 2\] list a rank more than once"),
    (([0, 1, 2],), {}, ValueError, r"ranks_to_exclude \[0, 1, 2\] exclude every rank of 'default'"),
    (([2],), {"shrink_flags": 7}, ValueError, r"shrink_flags must be SHRINK_DEFAULT \(0\) or SHRINK_ABORT \(1\)"),
], ids=["self", "empty", "out-of-range", "twice", "everyone", "flags"])
def test_bad_arguments_fail_on_the_calling_rank_and_change_nothing(args: tuple, kwargs: dict,
                                                                     error: type[Exception], says: str) -> None:
    def body(rank: int, size: int) -> float:
        if rank == 1:
            with pytest.raises(error, match=r"spmd.shrink_group on rank 1: " + says):
                spmd.shrink_group(*args, **kwargs)
        spmd.all_reduce(t := torch.ones(1))
        return t.item()

    assert run_ranks(body, 3, timeout=60) == [3.0, 3.0, 3.0]


def _survive_a_killed_rank(rank: int, world_size: int, transport: str) -> dict | None:
    import torch.distributed as torch_dist

    spmd.init_process_group(transport, timeout=60)
    try:
        spmd.all_reduce(torch.ones(2))
        if rank == 1:
            kill_self()
        with pytest.raises(PeerLostError, match=r"rank 1"):
            for _ in range(3):
                spmd.all_reduce(torch.ones(2))
        spmd.shrink_group([1])
        spmd.all_reduce(t := torch.tensor([float(spmd.get_rank() + 1)]))
        return {"rank": spmd.get_rank(), "size": spmd.get_world_size(), "sum": t.item(),
                "torch": [torch_dist.get_rank(), torch_dist.get_world_size()]}
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_the_survivors_of_a_killed_rank_shrink_past_it_and_go_on(procpool: ProcPool, transport: str) -> None:
    results = procpool.run(_survive_a_killed_rank, 3, timeout=90, args=(transport,), may_die=frozenset({1}))
    assert results[1] is None
    assert results[0] == {"rank": 0, "size": 2, "sum": 3.0, "torch": [0, 2]}
    assert results[2] == {"rank": 1, "size": 2, "sum": 3.0, "torch": [1, 2]}
