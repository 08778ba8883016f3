"""Failures become errors on every rank, never hangs or garbage: mismatched calls, timeouts, dead peers, bad input.

Each scenario runs on every transport it applies to (thread ranks over "threads" and "tcp"; a dead process needs
real processes, so that one uses the shared pool of rank processes over tcp).
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

import spmd
from spmd._core.errors import CollectiveMismatchError, CommTimeoutError, GroupAbortedError, PeerLostError
from spmd.comm.world import default_group
from spmd.testing import run_ranks
from tests.procpool import ProcPool, kill_self

TRANSPORTS = ["threads", "tcp"]
FAILING_TRANSPORTS = [*TRANSPORTS, "torch:gloo"]   # timeouts and dead peers; torch:gloo checks no fingerprints


def _mismatch(rank: int, call_a, call_b) -> str:
    """Rank 0 runs call_a, the others call_b (on different lines); returns the CollectiveMismatchError text."""
    with pytest.raises(CollectiveMismatchError) as info:
        if rank == 0:
            call_a()
        else:
            call_b()
    return str(info.value)


def _assert_both_sites(messages: list[str], a: str, b: str) -> None:
    for rank, message in enumerate(messages):
        assert a in message and b in message, f"rank {rank}: {message}"
        assert message.count("test_failures.py:") >= 2, f"rank {rank} does not name both call sites: {message}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_reduce_of_different_sizes_raises_on_every_rank(transport: str, world_size: int) -> None:
    def body(rank: int, size: int) -> str:
        message = _mismatch(rank, lambda: spmd.all_reduce(torch.ones(4)),
                            lambda: spmd.all_reduce(torch.ones(5)))
        with pytest.raises(GroupAbortedError):
            spmd.all_reduce(torch.ones(4))      # the group stays aborted
        return message

    _assert_both_sites(run_ranks(body, world_size, timeout=60, comm_timeout=30, backend=transport),
                       "shape=[4]", "shape=[5]")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_mismatch_names_each_ranks_own_shape(transport: str) -> None:
    def body(rank: int, size: int) -> str:
        return _mismatch(rank, lambda: spmd.all_reduce(torch.ones(2, 3)), lambda: spmd.all_reduce(torch.ones(7, 1)))

    _assert_both_sites(run_ranks(body, 2, timeout=60, comm_timeout=30, backend=transport), "shape=[2, 3]",
                       "shape=[7, 1]")


@pytest.mark.parametrize("transport", [*TRANSPORTS, "shm", "torch:gloo"])
def test_shapes_may_differ_where_the_element_counts_agree(transport: str) -> None:
    """As on torch's backends (DeepSpeed's pipeline engine all-reduces a 0-d norm on one stage, a [1] on another):
    the transports move tensors flat."""
    def body(rank: int, size: int) -> tuple[list[float], list[float]]:
        norm = torch.tensor(1.5) if rank == 0 else torch.tensor([2.0])
        spmd.all_reduce(norm)
        block = torch.arange(6.0).view(2, 3) if rank == 0 else torch.zeros(6)
        spmd.broadcast(block, src=0)
        return norm.reshape(-1).tolist(), block.reshape(-1).tolist()

    for norm, block in run_ranks(body, 2, timeout=60, comm_timeout=30, backend=transport):
        assert norm == [3.5] and block == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_reduce_against_all_gather_raises_on_every_rank(transport: str) -> None:
    def body(rank: int, size: int) -> str:
        out = torch.empty(8)
        return _mismatch(rank, lambda: spmd.all_reduce(torch.ones(4)),
                         lambda: spmd.all_gather_into_tensor(out[:4 * size], torch.ones(4)))

    _assert_both_sites(run_ranks(body, 2, timeout=60, comm_timeout=30, backend=transport), "all_reduce #1",
                       "all_gather #1")


@pytest.mark.parametrize("op", ["broadcast", "reduce", "gather", "scatter"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_different_roots_raise_on_every_rank(transport: str, op: str) -> None:
    def call(rank: int, root: int) -> None:
        t = torch.ones(3)
        if op == "broadcast":
            spmd.broadcast(t, src=root)
        elif op == "reduce":
            spmd.reduce(t, dst=root)
        elif op == "gather":
            spmd.gather(t, [torch.empty(3) for _ in range(3)] if rank == root else None, dst=root)
        else:
            spmd.scatter(t, [torch.ones(3) for _ in range(3)] if rank == root else None, src=root)

    def body(rank: int, size: int) -> str:
        # Ranks 0 and 1 both believe they are the root; rank 2 follows rank 0.
        return _mismatch(rank, lambda: call(rank, 0), lambda: call(rank, 0 if rank == 2 else 1))

    messages = run_ranks(body, 3, timeout=60, comm_timeout=30, backend=transport)
    _assert_both_sites(messages, "root=0", "root=1")


@pytest.mark.parametrize("transport", FAILING_TRANSPORTS)
def test_timeout_names_the_missing_rank_and_what_it_last_did(transport: str) -> None:
    done = threading.Event()
    caught: list[str] = []

    def body(rank: int, size: int) -> str | None:
        spmd.all_reduce(torch.ones(2))                               # rank 2's last operation
        if rank == 2:
            done.wait(timeout=30)     # stays alive (and answers status requests) until the others have failed
            return None
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            spmd.all_gather_into_tensor(torch.empty(6), torch.ones(2))
        elapsed = time.monotonic() - start
        caught.append(str(info.value))
        if len(caught) == 2:
            done.set()
        assert elapsed < 15, f"timeout took {elapsed:.1f}s"
        return str(info.value)

    messages = run_ranks(body, 3, timeout=60, comm_timeout=2, backend=transport)
    for message in messages[:2]:
        assert "all_gather #2" in message
        assert "never entered it: [2]" in message
        assert "rank 2 last completed all_reduce #1 called at test_failures.py:" in message


def _killed_peer(rank: int, world_size: int, transport: str) -> tuple[str, str, float] | None:
    spmd.init_process_group(transport, timeout=60)
    spmd.all_reduce(torch.ones(4))
    if rank == world_size - 1:
        kill_self()
    start = time.monotonic()
    try:
        for _ in range(3):
            spmd.all_gather_into_tensor(torch.empty(4 * world_size), torch.ones(4))
    except Exception as error:   # the test checks its type and text
        return type(error).__name__, str(error), time.monotonic() - start
    finally:
        spmd.destroy_process_group()
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, names, within", [
    ("tcp", "rank 2", 10),
    ("torch:gloo", "all_gather #2", 30),      # gloo's error gives the lost peer's address, not its rank
])
def test_killed_peer_process_fails_every_survivor_fast(procpool: ProcPool, transport: str, names: str,
                                                       within: float) -> None:
    results = procpool.run(_killed_peer, 3, timeout=90, args=(transport,), may_die=frozenset({2}))
    assert results[2] is None
    for rank in (0, 1):
        assert results[rank] is not None, f"rank {rank} did not notice the dead peer"
        name, message, elapsed = results[rank]
        assert name == PeerLostError.__name__, f"rank {rank}: {name}: {message}"
        assert names in message, message
        assert elapsed < within, f"rank {rank} took {elapsed:.1f}s to notice"
    survivors = procpool.run(_sum_of_ranks, 3, timeout=60)     # the pool replaced the dead worker
    assert survivors == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("transport", ["tcp", "torch:gloo"])
def test_abort_on_one_rank_fails_the_others_fast(transport: str) -> None:
    others_ready = threading.Barrier(3)

    def body(rank: int, size: int) -> float:
        spmd.barrier()
        others_ready.wait(timeout=30)      # every rank is out of the barrier before rank 0 aborts
        start = time.monotonic()
        if rank == 0:
            default_group().abort(RuntimeError("rank 0 gives up"))
            with pytest.raises(GroupAbortedError):
                spmd.all_reduce(torch.ones(3))
        else:
            with pytest.raises(GroupAbortedError, match=r"rank 0 on \S+ aborted .*rank 0 gives up"):
                spmd.all_reduce(torch.ones(3))
        return time.monotonic() - start

    assert max(run_ranks(body, 3, timeout=60, comm_timeout=60, backend=transport)) < 10


def _sum_of_ranks(rank: int, world_size: int) -> float:
    spmd.init_process_group("tcp", timeout=30)
    try:
        t = torch.tensor([float(rank)])
        spmd.all_reduce(t)
        return t.item()
    finally:
        spmd.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_input_raises_value_error_before_anything_is_sent(transport: str) -> None:
    def body(rank: int, size: int) -> float:
        solo = spmd.new_group([0])
        if rank == 0:    # only rank 0 errs: had anything been sent or counted, the all_reduce below would fail
            with pytest.raises(ValueError, match="dtype"):
                spmd.all_gather_into_tensor(torch.empty(4, dtype=torch.float64), torch.ones(2))
            with pytest.raises(ValueError, match="contiguous"):
                spmd.isend(torch.ones(4, 4)[:, 1], dst=1)
            with pytest.raises(ValueError, match="contiguous"):
                spmd.batch_isend_irecv([spmd.P2POp(spmd.irecv, torch.empty(2, 2).t(), 1)])
            with pytest.raises(ValueError, match="rank 5 is not in"):
                spmd.broadcast(torch.ones(2), src=5)
            with pytest.raises(ValueError, match="out of range"):
                spmd.reduce(torch.ones(2), group_dst=2)
            with pytest.raises(ValueError, match="BAND"):
                spmd.all_reduce(torch.ones(2), op=spmd.ReduceOp.BAND)
            with pytest.raises(ValueError, match="elements"):
                spmd.reduce_scatter_tensor(torch.empty(3), torch.ones(5))
            with pytest.raises(ValueError, match="split sizes"):
                spmd.all_to_all_single(torch.empty(4), torch.ones(4), [1, 1], [3, 3])
        else:
            with pytest.raises(ValueError, match="not in group"):
                spmd.all_reduce(torch.ones(2), group=solo)
            with pytest.raises(ValueError, match="not in group"):
                spmd.send(torch.ones(2), dst=0, group=solo)
        t = torch.tensor([float(rank + 1)])
        spmd.all_reduce(t)
        return t.item()

    assert run_ranks(body, 2, timeout=60, backend=transport) == [3.0, 3.0]


def test_a_batch_that_fails_to_start_aborts_its_group_and_fails_its_works() -> None:
    """A transport that fails starting a batch_isend_irecv: the caller gets the error naming the rank and the
    operation, the group is aborted (as after any failed send), and no Work of the batch stays in flight in the
    flight recorder."""
    def body(rank: int, size: int) -> tuple[str, list[str]]:
        group = default_group()

        def refuse(ops: list) -> None:
            raise RuntimeError("the device refused the batch")

        group.transport.start_p2p_batch = refuse
        with pytest.raises(RuntimeError, match="the device refused the batch") as info:
            spmd.batch_isend_irecv([spmd.P2POp(spmd.isend, torch.ones(2), 1 - rank),
                                    spmd.P2POp(spmd.irecv, torch.zeros(2), 1 - rank)])
        with pytest.raises(GroupAbortedError):
            spmd.all_reduce(torch.ones(1))
        records = group._recorder.snapshot()[f"{group.name}/p2p"]
        return str(info.value), [record["state"] for record in records]

    for rank, (message, states) in enumerate(run_ranks(body, 2, timeout=30)):
        assert f"rank {rank}" in message and "isend" in message, message
        assert states == ["failed", "failed"]


def test_a_barrier_with_a_timeout_fails_at_it_naming_the_missing_rank() -> None:
    """torch's barrier(timeout=...): that bound instead of the group's (60 s here), with the same error."""
    done = threading.Event()

    def body(rank: int, size: int) -> str | None:
        if rank == 1:
            done.wait(timeout=30)
            return None
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            spmd.barrier(timeout=datetime.timedelta(seconds=0.5))
        done.set()
        assert time.monotonic() - start < 20
        return str(info.value)

    message = run_ranks(body, 2, timeout=60, comm_timeout=60)[0]
    assert "barrier #1" in message and "never entered it: [1]" in message
