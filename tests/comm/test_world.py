"""The per-rank world and process groups: init/destroy, rank queries, new_group, Work, program order, and the
errors a user meets first (no init, double init, non-member groups, bad arguments). Threads transport."""

from __future__ import annotations

import inspect
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

import spmd
from spmd._core.errors import CollectiveMismatchError, CommTimeoutError, GroupAbortedError
from spmd.comm.world import current_world
from spmd.testing import run_ranks


def test_rank_queries_and_subgroups() -> None:
    def body(rank: int, world_size: int) -> tuple:
        evens = spmd.new_group([0, 2])
        odds = spmd.new_group([3, 1])
        mine = evens if rank % 2 == 0 else odds
        other = odds if rank % 2 == 0 else evens
        t = torch.tensor([float(rank)])
        spmd.all_reduce(t, group=mine)
        return (spmd.get_rank(), spmd.get_world_size(), spmd.get_rank(mine), spmd.get_world_size(mine),
                spmd.get_rank(other), spmd.get_process_group_ranks(mine), t.item(), spmd.get_backend())

    results = run_ranks(body, world_size=4, timeout=30)
    assert results[0] == (0, 4, 0, 2, -1, [0, 2], 2.0, "threads")
    assert results[1] == (1, 4, 0, 2, -1, [1, 3], 4.0, "threads")
    assert results[3] == (3, 4, 1, 2, -1, [1, 3], 4.0, "threads")


def test_group_rank_translation() -> None:
    def body(rank: int, world_size: int) -> tuple:
        group = spmd.new_group([1, 2])
        return spmd.get_group_rank(group, 2), spmd.get_global_rank(group, 0)

    assert run_ranks(body, world_size=3, timeout=30) == [(1, 1)] * 3


def test_non_member_group_is_refused_before_sending() -> None:
    def body(rank: int, world_size: int) -> None:
        group = spmd.new_group([0])
        if rank == 1:
            with pytest.raises(ValueError, match="rank 1 is not in group"):
                spmd.all_reduce(torch.ones(2), group=group)

    run_ranks(body, world_size=2, timeout=30)


def test_not_initialized_and_double_init() -> None:
    assert not spmd.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        spmd.get_rank()

    def body(rank: int, world_size: int) -> None:
        assert spmd.is_initialized()
        with pytest.raises(RuntimeError, match="already called"):
            spmd.init_process_group("threads", store=spmd.HashStore(), rank=rank, world_size=world_size)

    run_ranks(body, world_size=2, timeout=30)


@pytest.mark.parametrize("bad", [
    {"ranks": [0, 0]},
    {"ranks": [0, 5]},
    {"ranks": []},
])
def test_new_group_rejects_bad_ranks(bad: dict) -> None:
    def body(rank: int, world_size: int) -> None:
        with pytest.raises(ValueError):
            spmd.new_group(**bad)

    run_ranks(body, world_size=2, timeout=30)


def test_init_argument_errors() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        spmd.init_process_group("carrier-pigeon", store=spmd.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank and world_size"):
        spmd.init_process_group("threads", store=spmd.HashStore())
    with pytest.raises(ValueError, match="out of range"):
        spmd.init_process_group("threads", store=spmd.HashStore(), rank=3, world_size=2)
    with pytest.raises(ValueError, match="threads backend needs the store"):
        spmd.init_process_group("threads", rank=0, world_size=1)
    assert not spmd.is_initialized()


def test_async_ops_complete_in_program_order_and_futures_resolve() -> None:
    def body(rank: int, world_size: int) -> list[float]:
        works = []
        for step in range(20):
            works.append(spmd.all_reduce(torch.full((3,), float(rank + step)), async_op=True))
        last = torch.tensor([float(rank)])
        future = spmd.all_reduce(last, async_op=True).get_future()
        future.wait()
        assert all(w.is_completed() for w in works)   # issued earlier, so finished before `last`
        blocked = torch.ones(2)
        spmd.all_reduce(blocked, async_op=True).block_current_stream()   # torch's name for a stream-side wait
        assert blocked.tolist() == [3.0, 3.0]
        results = [w.result()[0][0].item() for w in works]
        return [*results, future.value()[0].item()]

    per_rank = run_ranks(body, world_size=3, timeout=30)
    expected = [float(3 * step + 3) for step in range(20)] + [3.0]
    assert per_rank == [expected] * 3


def test_sync_op_after_async_ops_waits_for_them() -> None:
    def body(rank: int, world_size: int) -> float:
        big = torch.ones(1 << 16)
        work = spmd.all_reduce(big, async_op=True)
        small = torch.ones(1)
        spmd.all_reduce(small)
        assert work.is_completed()
        return big[0].item() + small.item()

    assert run_ranks(body, world_size=2, timeout=30) == [4.0, 4.0]


def test_in_place_collective_bumps_autograd_version() -> None:
    def body(rank: int, world_size: int) -> None:
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        z = y.sigmoid()            # saves its output for backward
        spmd.all_reduce(z.detach())  # detach shares z's version counter
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()

    run_ranks(body, world_size=2, timeout=30)


def test_mismatch_raises_on_every_rank_with_both_call_sites() -> None:
    def body(rank: int, world_size: int) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            spmd.all_reduce(torch.ones(4 + rank))
        with pytest.raises(GroupAbortedError, match="aborted"):
            spmd.all_reduce(torch.ones(1))
        return str(info.value)

    messages = run_ranks(body, world_size=2, timeout=30)
    for message in messages:
        assert "shape=[4]" in message and "shape=[5]" in message
        assert message.count("test_world.py:") >= 2


def test_timeout_names_the_rank_that_never_came_and_where_it_is() -> None:
    release = threading.Event()

    def body(rank: int, world_size: int) -> str:
        if rank == 1:
            spmd.barrier()                          # the last thing rank 1 does on the group
            release.wait(timeout=20)                # "computing" until rank 0 has timed out
            return ""
        spmd.barrier()
        try:
            with pytest.raises(CommTimeoutError) as info:
                spmd.all_reduce(torch.ones(2))
        finally:
            release.set()
        return str(info.value)

    message = run_ranks(body, world_size=2, timeout=30, comm_timeout=1.0)[0]
    assert "all_reduce #2" in message and "never entered it: [1]" in message
    assert "rank 1 last completed barrier #1 called at test_world.py:" in message
    lines, first = inspect.getsourcelines(body)
    waiting_line = first + next(i for i, line in enumerate(lines) if "release.wait(timeout=20)" in line)
    now = message.split("; now at ", 1)[1].splitlines()[0]
    assert now.startswith("threading.py:") and now.endswith(f" <- test_world.py:{waiting_line} in body"), now
    assert "rank 0 is still in all_reduce #2" in message and message.count("now at") == 1


def test_work_wait_timeout_and_state() -> None:
    work = spmd.Work("demo")
    with pytest.raises(CommTimeoutError, match="still running"):
        work.wait(timeout=0.01)
    work.to_failed(ValueError("boom"))
    assert work.is_completed() and not work.is_success()
    with pytest.raises(ValueError, match="boom"):
        work.wait()
    with pytest.raises(ValueError, match="boom"):
        work.get_future().wait()


def test_run_ranks_reraises_first_failure_with_rank() -> None:
    def body(rank: int, world_size: int) -> None:
        if rank == 2:
            raise KeyError("bad rank")
        spmd.barrier()

    with pytest.raises(KeyError) as info:
        run_ranks(body, world_size=3, timeout=30)
    assert any("rank 2 of 3" in note for note in info.value.__notes__)


def _in_rank_threads(rank_main: Callable[[int], None], world_size: int = 2, timeout: float = 60.0) -> None:
    """Run rank_main(rank) in a thread per rank, each initializing its own world (unlike run_ranks, which
    initializes them); re-raise the first rank's error."""
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as error:   # re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("backend", ["threads", "tcp"])
def test_reinitialize_over_the_same_store(backend: str) -> None:
    store = spmd.HashStore(timeout=30)
    results: list[float] = []

    def rank_main(rank: int) -> None:
        for _ in range(3):   # destroy, then init again: fresh keys, no stale addresses
            spmd.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=30)
            t = torch.ones(3)
            spmd.all_reduce(t)
            results.append(t[0].item())
            spmd.destroy_process_group()

    _in_rank_threads(rank_main)
    assert results == [2.0] * 6


def test_a_rank_that_rejoins_before_rank_0_has_left_keeps_its_connection() -> None:
    """tcp:// init, destroy, init again: rank 1 re-joins through rank 0's store server while rank 0 is still in
    the first world. Rank 0 keeps the server across its destroy (Note: rank 0 keeps its store server), so rank 1's
    rendezvous is not cut off (it lost its connection mid-rendezvous when rank 0's destroy stopped the server)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    results: list[float] = []

    def rank_main(rank: int) -> None:
        spmd.init_process_group("tcp", init_method=init, rank=rank, world_size=2, timeout=30,
                                torch_default_group=False)
        spmd.all_reduce(torch.ones(1))
        if rank == 0:     # stay in the first world until rank 1 has counted its second init on the server
            store = current_world().store
            deadline = time.monotonic() + 30
            while not (store.check(["spmd/inits/rank1"]) and store.get("spmd/inits/rank1") == b"2"):
                assert time.monotonic() < deadline, "rank 1 did not re-join"
                time.sleep(0.001)
        spmd.destroy_process_group()
        spmd.init_process_group("tcp", init_method=init, rank=rank, world_size=2, timeout=30,
                                torch_default_group=False)
        t = torch.ones(2)
        spmd.all_reduce(t)
        results.append(t[0].item())
        spmd.destroy_process_group()

    _in_rank_threads(rank_main)
    assert results == [2.0, 2.0]


def test_torchs_newer_keyword_arguments_are_taken() -> None:
    """Arguments torch 2.13's signatures have that scripts pass by name: the object collectives' group_src /
    group_dst, use_batch, new_group's sort_ranks (order given = global order only), new_subgroups_by_enumeration's
    pg_options and group_desc, supports_complex(reduceOp=...)."""
    def body(rank: int, size: int) -> dict:
        sub = spmd.new_group([1, 2, 3])
        out: dict = {"complex": (spmd.supports_complex(reduceOp=spmd.ReduceOp.SUM),
                                 spmd.supports_complex(reduceOp=spmd.ReduceOp.MAX))}
        mine, _ = spmd.new_subgroups_by_enumeration([[0, 1], [2, 3]], pg_options=None, group_desc="pairs")
        out["pair"] = list(mine.ranks)
        assert spmd.new_group([0, 1, 2, 3], sort_ranks=False) is not None
        with pytest.raises(ValueError, match="sort_ranks=False with ranks \\[3, 2, 1, 0\\] out of order"):
            spmd.new_group([3, 2, 1, 0], sort_ranks=False)
        if rank == 0:
            spmd.send_object_list([{"from": 0}], dst=1, use_batch=True)
            return out
        objects: list = [f"rank {rank}", None]
        spmd.broadcast_object_list(objects, group=sub, group_src=1)         # group rank 1: global rank 2
        gathered = [None] * 3 if rank == 1 else None
        spmd.gather_object(rank * 10, gathered, group=sub, group_dst=0)      # to global rank 1
        scattered: list = [None]
        spmd.scatter_object_list(scattered, [f"to {r}" for r in (1, 2, 3)] if rank == 3 else None, group=sub,
                                 group_src=2)
        with pytest.raises(ValueError, match="pass src or group_src, not both"):
            spmd.broadcast_object_list([None], src=1, group=sub, group_src=0)
        if rank == 1:
            received: list = [None]
            spmd.recv_object_list(received, src=0, use_batch=True)
            out["received"] = received
        out.update(broadcast=objects[0], gathered=gathered, scattered=scattered[0])
        return out

    results = run_ranks(body, 4, timeout=60)
    for rank, out in enumerate(results):
        assert out["complex"] == (True, False) and out["pair"] == ([0, 1] if rank < 2 else [2, 3])
        if rank:
            assert out["broadcast"] == "rank 2" and out["scattered"] == f"to {rank}"
            assert out["gathered"] == ([10, 20, 30] if rank == 1 else None)
    assert results[1]["received"] == [{"from": 0}]
