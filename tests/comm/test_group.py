"""ProcessGroup's life on one rank: OPEN -> ABORTED on the first failure, OPEN or ABORTED -> CLOSED on destroy."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import spmd
from spmd._core.errors import CommError, GroupAbortedError
from spmd.comm.debug import Fingerprint
from spmd.comm.group import GroupState, NonMemberGroup, ProcessGroup
from spmd.comm.world import current_world
from spmd.testing import run_ranks


def test_an_aborted_group_stays_aborted_until_it_is_closed() -> None:
    def body(rank: int, size: int) -> None:
        group = spmd.new_group([0])
        assert group.state is GroupState.OPEN
        spmd.all_reduce(torch.ones(2), group=group)
        group.abort(CommError("first"))
        group.abort(CommError("second"))                 # the first failure wins
        assert group.state is GroupState.ABORTED
        with pytest.raises(GroupAbortedError, match="First failure: first"):
            spmd.all_reduce(torch.ones(2), group=group)
        spmd.destroy_process_group(group)
        assert group.state is GroupState.CLOSED
        with pytest.raises(RuntimeError, match="the group was destroyed"):
            spmd.all_reduce(torch.ones(2), group=group)
        spmd.all_reduce(torch.ones(2))                   # the default group is untouched

    run_ranks(body, 1, timeout=30)


def test_closing_is_final_and_idempotent() -> None:
    def body(rank: int, size: int) -> None:
        group = spmd.new_group([0])
        work = spmd.all_reduce(torch.ones(2), group=group, async_op=True)
        group.close()                                    # the queued op finishes first
        assert work.wait() and group.state is GroupState.CLOSED
        group.close()
        group.abort(CommError("late"))
        assert group.state is GroupState.CLOSED
        with pytest.raises(RuntimeError, match="the group was destroyed"):
            spmd.barrier(group=group)

    run_ranks(body, 1, timeout=30)


def test_torch_compatibility_arguments_are_accepted_and_ignored() -> None:
    store = spmd.HashStore(timeout=30)
    spmd.init_process_group("threads", store=store, rank=0, world_size=1, group_name="mine")
    try:
        assert spmd.comm.world.default_group().group_name == "default"
        spmd.barrier(device_ids=[0])
        with pytest.raises(TypeError, match="device_ids must be a list of ints, got int"):
            spmd.barrier(device_ids=0)
    finally:
        spmd.destroy_process_group()


@pytest.mark.parametrize("backend", ["threads", "tcp"])
def test_a_group_made_after_another_was_destroyed_gets_a_fresh_name(backend: str) -> None:
    """Group names count the new_group calls, not the groups alive: a name taken from the live count was
    reused after a destroy, and the new group's set-up read the keys of the live group of that name."""
    def body(rank: int, size: int) -> tuple[list[str], list[float]]:
        first, second = spmd.new_group([0, 1]), spmd.new_group([0, 1])
        spmd.destroy_process_group(first)
        third = spmd.new_group([0, 1])
        t = torch.ones(2)
        spmd.all_reduce(t, group=second)
        spmd.all_reduce(t, group=third)
        return [first.group_name, second.group_name, third.group_name], t.tolist()

    assert run_ranks(body, 2, timeout=60, backend=backend) == [(["1", "2", "3"], [4.0, 4.0])] * 2


@pytest.mark.parametrize("backend", ["threads", "shm", "tcp"])
def test_a_group_with_local_synchronization_is_made_by_its_members_alone(backend: str) -> None:
    """new_group(use_local_synchronization=True), as torch's: ranks 0-1 and 2-3 each make a group of their own
    (twice, so a member set's count names them apart) without the other pair calling; a world-wide new_group
    after them is named and served as if they had not been made."""
    def body(rank: int, size: int) -> tuple[list[float], list[float], str, bool]:
        pair = [0, 1] if rank < 2 else [2, 3]
        first = spmd.new_group(pair, use_local_synchronization=True)
        second = spmd.new_group(pair, use_local_synchronization=True)
        outsider = spmd.new_group([2] if rank < 2 else [0], use_local_synchronization=True)   # not a member
        everyone = spmd.new_group(group_desc="all of them")
        t = torch.full((2,), float(rank))
        spmd.all_reduce(t, group=first)
        spmd.all_reduce(t, group=second)
        u = torch.ones(2)
        spmd.all_reduce(u, group=everyone)
        return t.tolist(), u.tolist(), everyone.group_name, isinstance(outsider, NonMemberGroup)

    results = run_ranks(body, 4, timeout=60, backend=backend)
    assert results == [([2.0, 2.0], [4.0, 4.0], "1", True)] * 2 + [([10.0, 10.0], [4.0, 4.0], "1", True)] * 2


@pytest.mark.parametrize("backend", ["threads", "shm", "tcp"])
def test_finished_ops_do_not_keep_their_tensors_alive(backend: str) -> None:
    # FSDP frees an all-gather's buffers as soon as it drops them; a transport or executor still holding the
    # last op's tensors until the next op arrives kept one group's worth of buffers alive for nothing.
    def body(rank: int, size: int) -> list[bool]:
        inp, out = torch.ones(1000), torch.empty(1000 * size)
        spmd.all_gather_into_tensor(out, inp, async_op=True).wait()
        spmd.barrier()      # the group's next op: it runs once the executor has let go of the last one
        refs = [weakref.ref(inp.untyped_storage()), weakref.ref(out.untyped_storage())]
        del inp, out
        gc.collect()
        return [ref() is None for ref in refs]

    assert run_ranks(body, 2, backend=backend) == [[True, True]] * 2


@pytest.mark.parametrize("backend", ["threads", "shm", "tcp"])
def test_all_gather_in_place(backend: str) -> None:
    # The input may be this rank's own block of the output (as NCCL allows): FSDP gathers that way.
    def body(rank: int, size: int) -> bool:
        block = 10007
        out = torch.empty(size * block)
        out[rank * block:(rank + 1) * block] = torch.arange(block, dtype=torch.float32) + 1e6 * rank
        spmd.all_gather_into_tensor(out, out[rank * block:(rank + 1) * block])
        return torch.equal(out, torch.cat([torch.arange(block, dtype=torch.float32) + 1e6 * r for r in range(size)]))

    assert run_ranks(body, 3, backend=backend) == [True] * 3


def test_observers_see_every_collective_on_the_ranks_groups_and_no_point_to_point() -> None:
    def body(rank: int, world_size: int) -> list[tuple[str, str, int]]:
        world = current_world()
        pair = spmd.new_group([0, 1])
        seen: list[tuple[str, str, int]] = []

        def observer(group: ProcessGroup, fingerprint: Fingerprint) -> None:
            seen.append((group.name, fingerprint.op, fingerprint.seq))

        assert world.observers.callbacks == () and pair.observers is world.observers
        world.observers.add(observer)
        t = torch.ones(2)
        spmd.all_reduce(t)
        spmd.all_gather_into_tensor(torch.empty(2 * world_size), t, group=pair)
        spmd.broadcast(t, src=0, async_op=True).wait()
        if rank == 0:
            spmd.send(t, dst=1)
        else:
            spmd.recv(t, src=0)
        world.observers.remove(observer)
        world.observers.remove(observer)          # a second remove finds nothing and does nothing
        spmd.barrier()
        assert world.observers.callbacks == ()
        return seen

    expected = [("default", "all_reduce", 1), ("1", "all_gather", 1), ("default", "broadcast", 2)]
    assert run_ranks(body, 2, timeout=30) == [expected] * 2
