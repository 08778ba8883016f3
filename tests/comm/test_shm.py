"""The shm transport: every collective and P2P op through shared memory, chunking, mismatches, timeouts,
aborts, segment hygiene (no name left in /dev/shm, whatever happens), dead-peer detection across real
processes, and the hierarchical algorithm across two fake hosts.

Most tests run thread ranks over the shm transport (run_ranks(..., backend="shm")): the same segment code,
one process. Tests that need several processes (kill a rank, exit without cleanup) spawn them with timeouts.
Small staging slots and rings (monkeypatched) make modest tensors span many chunks and ring laps.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import spmd
from spmd._core.deadline import Deadline
from spmd._core.errors import CollectiveMismatchError, CommError, CommTimeoutError, PeerLostError
from spmd.comm.debug import Fingerprint
from spmd.comm.transports.base import OpContext, Transport, TransportSpec, create_transport
from spmd.comm.transports.shm import local as shm_local
from spmd.comm.transports.shm import names as shm_names
from spmd.comm.transports.shm import p2p as shm_p2p
from spmd.comm.transports.shm import peer_memory
from spmd.comm.transports.shm import segment as shm_segment
from spmd.comm.transports.shm.hierarchical import HierarchicalTransport
from spmd.comm.transports.shm.local import LocalShmTransport
from spmd.comm.work import Work
from spmd.comm.world import current_world
from spmd.testing import run_ranks

SHM = "shm"


def _segments_of(pids: list[int]) -> list[str]:
    """Names in /dev/shm created by any of `pids` (segment names start with spmd-<creator pid>-)."""
    prefixes = tuple(f"{shm_segment.NAME_PREFIX}{pid}-" for pid in pids)
    return [name for name in os.listdir(shm_segment.SHM_DIR) if name.startswith(prefixes)]


@pytest.fixture
def small_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 KiB staging slots and rings: a few thousand elements take many chunks (and ring laps)."""
    monkeypatch.setattr(shm_segment, "SLOT_BYTES", 4096)
    monkeypatch.setattr(shm_segment, "RING_BYTES", 4096)
    monkeypatch.setattr(shm_local, "SMALL_BYTES", 256)


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent values that every dtype represents exactly (so sums compare bit for bit)."""
    values = (torch.arange(n) * 7 + rank * 3) % 11
    if dtype is torch.bool:
        return values % 3 == rank % 2
    return values.to(dtype)


# -- collectives --------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("lag", [1, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_matches_the_local_computation(world_size: int, lag: int, small_slots: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_segment, "LAG", lag)      # lock-step phases, and ranks up to 2 phases apart
    sizes = [0, 1, 7, 1000, 5003]      # with 4 KiB slots: one chunk, and many uneven chunks

    def body(rank: int, size: int) -> None:
        for dtype in DTYPES:
            for n in sizes:
                everyone = [_inputs(r, n, dtype) for r in range(size)]
                op = spmd.ReduceOp.SUM
                total = everyone[0].clone()
                for other in everyone[1:]:
                    total = total | other if dtype is torch.bool else total + other

                t = everyone[rank].clone()
                spmd.all_reduce(t, op=op)
                assert torch.equal(t, total), (dtype, n)

                t = everyone[rank].clone()
                spmd.reduce(t, dst=size - 1, op=op)
                assert torch.equal(t, total if rank == size - 1 else everyone[rank]), (dtype, n)

                t = everyone[rank].clone()
                spmd.broadcast(t, src=size // 2)
                assert torch.equal(t, everyone[size // 2])

                out = torch.empty(n * size, dtype=dtype)
                spmd.all_gather_into_tensor(out, everyone[rank])
                assert torch.equal(out, torch.cat(everyone))

                full = [_inputs(r, n * size, dtype) for r in range(size)]
                full_total = full[0].clone()
                for other in full[1:]:
                    full_total = full_total | other if dtype is torch.bool else full_total + other
                out = torch.empty(n, dtype=dtype)
                spmd.reduce_scatter_tensor(out, full[rank])
                assert torch.equal(out, full_total[rank * n:(rank + 1) * n]), (dtype, n)

                gathered = [torch.empty(n, dtype=dtype) for _ in range(size)] if rank == 0 else None
                spmd.gather(everyone[rank], gathered, dst=0)
                if rank == 0:
                    assert all(torch.equal(a, b) for a, b in zip(gathered, everyone))

                out = torch.empty(n, dtype=dtype)
                spmd.scatter(out, [_inputs(r, n, dtype) for r in range(size)] if rank == 1 % size else None,
                             src=1 % size)
                assert torch.equal(out, everyone[rank])
        spmd.barrier()

    run_ranks(body, world_size=world_size, timeout=90, backend=SHM)


@pytest.mark.parametrize("op", list(spmd.ReduceOp))
def test_every_reduce_op_small_and_chunked(op: spmd.ReduceOp, small_slots: None) -> None:
    dtype = torch.float64 if op in (spmd.ReduceOp.AVG, spmd.ReduceOp.PRODUCT) else torch.int32

    def body(rank: int, size: int) -> None:
        for n in (5, 40, 3001):          # below SMALL_BYTES, one chunk, many chunks
            everyone = [_inputs(r, n, dtype) + 1 for r in range(size)]
            expected = everyone[0].clone()
            for other in everyone[1:]:
                expected = {
                    spmd.ReduceOp.SUM: torch.add, spmd.ReduceOp.AVG: torch.add, spmd.ReduceOp.PRODUCT: torch.mul,
                    spmd.ReduceOp.MIN: torch.minimum, spmd.ReduceOp.MAX: torch.maximum,
                    spmd.ReduceOp.BAND: torch.bitwise_and, spmd.ReduceOp.BOR: torch.bitwise_or,
                    spmd.ReduceOp.BXOR: torch.bitwise_xor}[op](expected, other)
            if op is spmd.ReduceOp.AVG:
                expected = expected / size
            t = everyone[rank].clone()
            spmd.all_reduce(t, op=op)
            assert torch.equal(t, expected)
            block = n // size            # reduce_scatter of the first block * size elements
            out = torch.empty(block, dtype=dtype)
            spmd.reduce_scatter_tensor(out, everyone[rank][:block * size], op=op)
            assert torch.equal(out, expected[rank * block:(rank + 1) * block])

    run_ranks(body, world_size=3, timeout=60, backend=SHM)


def test_large_tensors_with_the_default_slots_are_bit_identical_on_every_rank() -> None:
    n = (3 << 20) // 4 + 5     # 3 MiB of float32 and a bit: several default 1 MiB chunks, an odd tail

    def body(rank: int, size: int) -> torch.Tensor:
        t = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        expected = sum(torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size))
        spmd.all_reduce(t)
        assert torch.allclose(t, expected, rtol=1e-5, atol=1e-5)     # the sum's order differs from this one
        return t

    results = run_ranks(body, world_size=3, timeout=60, backend=SHM)
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_with_uneven_and_empty_splits(world_size: int, small_slots: None) -> None:
    def body(rank: int, size: int) -> None:
        sends = [(rank * 7 + dst * 13) % 5 * 300 if dst != rank else 3 for dst in range(size)]   # 0..1200
        receives = [(src * 7 + rank * 13) % 5 * 300 if src != rank else 3 for src in range(size)]
        inp = torch.cat([torch.full((count,), rank * 100 + dst, dtype=torch.int32)
                         for dst, count in enumerate(sends)])
        out = torch.empty(sum(receives), dtype=torch.int32)
        spmd.all_to_all_single(out, inp, receives, sends)
        expected = torch.cat([torch.full((count,), src * 100 + rank, dtype=torch.int32)
                              for src, count in enumerate(receives)])
        assert torch.equal(out, expected)
        outs = [torch.empty(2 + src, dtype=torch.float16) for src in range(size)]
        spmd.all_to_all(outs, [torch.full((2 + rank,), float(rank)).half() for _ in range(size)])
        assert all(torch.equal(o, torch.full((2 + src,), float(src)).half()) for src, o in enumerate(outs))

    run_ranks(body, world_size=world_size, timeout=60, backend=SHM)


def test_subgroups_async_ops_and_in_place_all_gather(small_slots: None) -> None:
    def body(rank: int, size: int) -> None:
        pair, _ = spmd.new_subgroups(2)
        works = [spmd.all_reduce(t, group=pair, async_op=True) for t in [torch.full((900,), float(rank))] * 3]
        for work in works:
            work.wait()
        big = torch.empty(4 * 1000)
        mine = big[rank * 1000:(rank + 1) * 1000]
        mine.fill_(rank)
        spmd.all_gather_into_tensor(big, mine)              # FSDP's in-place form: input is a view of the output
        assert torch.equal(big, torch.arange(4.0).repeat_interleave(1000))

    run_ranks(body, world_size=4, timeout=60, backend=SHM)


# -- point to point -----------------------------------------------------------------------------------------

def _p2p_exchange(rank: int, big_numel: int) -> int:
    """Both ranks of a pair send first (a message larger than the ring among them), tags out of order,
    blocking sends on both sides (small ones, then ones large enough to go by rendezvous), a send to self and
    odd dtypes; asserts what each rank receives. Returns how many messages to the peer went by rendezvous."""
    peer = 1 - rank
    big = torch.arange(big_numel, dtype=torch.float64) + rank
    sends = [spmd.isend(big, peer), spmd.isend(torch.tensor([rank, 1]), peer, tag=5),
             spmd.isend(torch.tensor([rank, 2]), peer, tag=5), spmd.isend(torch.tensor([rank, 3]), peer, tag=7)]
    got7, got5a, got5b = (torch.empty(2, dtype=torch.int64) for _ in range(3))
    spmd.recv(got7, peer, tag=7)                         # a later tag first: the earlier ones wait unmatched
    recvs = [spmd.irecv(got5a, peer, tag=5), spmd.irecv(got5b, peer, tag=5)]
    received = torch.empty(big_numel, dtype=torch.float64)
    spmd.recv(received, peer)
    for work in sends + recvs:
        work.wait()
    assert torch.equal(received, torch.arange(big_numel, dtype=torch.float64) + peer)
    assert got7.tolist() == [peer, 3] and got5a.tolist() == [peer, 1] and got5b.tolist() == [peer, 2]
    # blocking sends on both sides first: the progress threads buffer, so neither waits for the other
    spmd.send(torch.full((20_000,), float(rank)), peer)
    back = torch.empty(20_000)
    spmd.recv(back, peer)
    assert torch.equal(back, torch.full((20_000,), float(peer)))
    spmd.send(big * 2, peer)        # the first large message taught the pair whether a receiver may read it
    spmd.recv(received, peer)
    assert torch.equal(received, (torch.arange(big_numel, dtype=torch.float64) + peer) * 2)
    mine = torch.tensor([3.5, rank])
    to_self = spmd.isend(mine, rank, tag=2)
    echo = torch.empty(2)
    spmd.irecv(echo, rank, tag=2).wait()
    to_self.wait()
    assert echo.tolist() == [3.5, rank]
    for dtype in (torch.bool, torch.complex64, torch.bfloat16):
        if rank == 0:
            spmd.send(torch.ones(3, dtype=dtype), peer)
        else:
            z = torch.zeros(3, dtype=dtype)
            spmd.recv(z, 0)
            assert torch.equal(z, torch.ones(3, dtype=dtype))
    return _p2p_engine()._tickets[peer]


def _p2p_engine() -> shm_p2p.P2PEngine:
    transport = current_world().default_group.transport
    assert isinstance(transport, LocalShmTransport)
    return transport._p2p


def test_p2p_both_sides_send_first_large_messages_and_tags_in_order(small_slots: None) -> None:
    by_rendezvous = run_ranks(lambda rank, size: _p2p_exchange(rank, 50_000), world_size=2, timeout=60,
                              backend=SHM)   # 400 KB, 4 KiB ring
    assert by_rendezvous == [1, 1]           # thread ranks read each other's memory: the second large one


def test_p2p_rendezvous_to_a_receiver_not_posted_yet_and_of_the_wrong_size() -> None:
    def body(rank: int, size: int) -> list[float]:
        peer, numel = 1 - rank, shm_p2p.RENDEZVOUS_BYTES // 4
        spmd.send(torch.zeros(numel), peer) if rank == 0 else spmd.recv(torch.zeros(numel), peer)   # probe
        spmd.barrier()                       # rank 1 has answered the probe before rank 0 sends again
        if rank == 0:
            sends = [spmd.isend(torch.full((numel,), float(k)), peer) for k in range(3)]
            spmd.barrier()                   # the receives are posted only now: copied into private buffers
            for work in sends:
                work.wait()
            spmd.send(torch.ones(numel), peer)
            assert _p2p_engine()._tickets[peer] == 4
            return []
        spmd.barrier()
        got = [torch.empty(numel) for _ in range(3)]
        for tensor in got:
            spmd.recv(tensor, peer)
        with pytest.raises(CommError, match=rf"holds {numel} torch\.float32 elements but the receive buffer holds"):
            spmd.recv(torch.empty(numel + 1), peer)       # the sender's Work completes all the same
        return [tensor.unique().item() for tensor in got]

    assert run_ranks(body, world_size=2, timeout=30, backend=SHM)[1] == [0.0, 1.0, 2.0]


def _p2p_worker(rank: int, world_size: int, results: Any, store_path: str, one_copy: bool = True) -> None:
    """_p2p_exchange between processes, where waiting threads move ring data themselves, then a ping-pong."""
    torch.set_num_threads(1)
    if not one_copy:
        os.environ[peer_memory.ENABLED_ENV] = "0"
    spmd.init_process_group("shm", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=60)
    try:
        by_rendezvous = _p2p_exchange(rank, 400_000)   # 3.2 MB through a 1 MiB ring
        t = torch.zeros(1, dtype=torch.int64)
        polled = []
        for step in range(200):                        # each message one more than the one it answers
            if rank == step % 2:
                t += 1
                spmd.send(t, 1 - rank)
            else:
                work = spmd.irecv(t, 1 - rank)     # complete at once if the progress thread got it first
                polled.append("done" if work.is_completed() else "polls" if work.poll is not None else "neither")
                work.wait()
        results.send((rank, t.item(), "neither" not in polled and "polls" in polled, by_rendezvous))
    except BaseException as error:
        results.send((rank, repr(error), False, 0))
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("one_copy", [True, False], ids=["rendezvous", "rings-only"])
def test_p2p_between_processes_with_waiters_moving_the_data(tmp_path, one_copy: bool) -> None:
    reports = _sorted_reports(_p2p_worker, 2, str(tmp_path / "store"), one_copy)
    used = 1 if one_copy else 0        # the second large message, once the receiver found it may read the sender
    assert reports == [(0, 200, True, used), (1, 200, True, used)], reports


def test_p2p_size_mismatch_fails_the_receive() -> None:
    def body(rank: int, size: int) -> None:
        if rank == 0:
            spmd.send(torch.ones(4), 1)
        else:
            with pytest.raises(CommError, match=r"holds 4 torch\.float32 elements but the receive buffer holds 5"):
                spmd.recv(torch.empty(5), 0)

    run_ranks(body, world_size=2, timeout=30, backend=SHM)


# -- failures -----------------------------------------------------------------------------------------------

def test_mismatched_collectives_raise_on_every_rank_with_both_call_sites() -> None:
    def body(rank: int, size: int) -> str:
        with pytest.raises(CollectiveMismatchError) as raised:
            if rank == 0:
                spmd.all_reduce(torch.ones(4))
            else:
                spmd.all_reduce(torch.ones(5))
        return str(raised.value)

    messages = run_ranks(body, world_size=2, timeout=30, backend=SHM)
    for message in messages:
        assert "shape=[4]" in message and "shape=[5]" in message
        assert len(set(re.findall(r"test_shm\.py:\d+", message))) == 2     # both ranks' call sites


def test_mismatched_op_and_root_are_caught() -> None:
    def body(rank: int, size: int) -> None:
        with pytest.raises(CollectiveMismatchError, match="broadcast"):
            if rank == 0:
                spmd.broadcast(torch.ones(3), src=0)
            else:
                spmd.all_reduce(torch.ones(3))

    run_ranks(body, world_size=2, timeout=30, backend=SHM)

    def roots(rank: int, size: int) -> None:
        with pytest.raises(CollectiveMismatchError, match="root="):
            spmd.broadcast(torch.ones(3), src=rank)

    run_ranks(roots, world_size=2, timeout=30, backend=SHM)


def test_all_to_all_split_mismatch_is_reported_on_every_rank() -> None:
    def body(rank: int, size: int) -> None:
        out = torch.empty(4)
        with pytest.raises(CollectiveMismatchError, match="expects 2 elements from rank 0, which sends 1"):
            spmd.all_to_all_single(out, torch.ones(4), [2, 2], [1, 3] if rank == 0 else [2, 2])

    run_ranks(body, world_size=2, timeout=30, backend=SHM)


def test_a_missing_peer_times_out_at_the_deadline() -> None:
    rank_0_done = threading.Event()

    def body(rank: int, size: int) -> None:
        if rank == 0:
            started = time.monotonic()
            with pytest.raises(CommTimeoutError, match=r"all_reduce[\s\S]*never entered it: \[1\]"):
                spmd.all_reduce(torch.ones(3))
            assert 0.9 < time.monotonic() - started < 10
            rank_0_done.set()
        else:
            rank_0_done.wait(timeout=30)     # alive (answering status requests) but never calling all_reduce

    run_ranks(body, world_size=2, timeout=30, comm_timeout=1.0, backend=SHM)


def test_a_failing_rank_wakes_the_waiting_peers_at_once() -> None:
    started = time.monotonic()

    def body(rank: int, size: int) -> None:
        if rank == 0:
            raise KeyError("rank 0 gave up")
        spmd.all_reduce(torch.ones(10))

    with pytest.raises(KeyError, match="gave up"):
        run_ranks(body, world_size=3, timeout=60, comm_timeout=60, backend=SHM)
    assert time.monotonic() - started < 10


def test_no_segment_name_outlives_the_group_set_up(small_slots: None) -> None:
    def body(rank: int, size: int) -> list[str]:
        spmd.new_group([0, 1])
        spmd.barrier()                  # every group's set-up is over on every rank
        return _segments_of([os.getpid()])

    assert run_ranks(body, world_size=3, timeout=30, backend=SHM) == [[], [], []]
    assert _segments_of([os.getpid()]) == []


# -- real processes -----------------------------------------------------------------------------------------

class _Inbox:
    """The parent's end of one pipe per worker: a worker killed mid-send can't block the others (a shared
    multiprocessing.Queue can: its writers share a lock that a SIGKILLed holder never releases)."""

    def __init__(self, readers: list[Any]) -> None:
        self._readers = readers

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while self._readers:
            ready = multiprocessing.connection.wait(self._readers, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for reader in ready:
                try:
                    return reader.recv()
                except EOFError:          # that worker is gone
                    self._readers.remove(reader)
        raise TimeoutError(f"no message from the workers within {timeout:.0f}s")


def _spawn(target: Callable[..., None], count: int, *args: Any) -> tuple[list[multiprocessing.Process], _Inbox]:
    """Start `count` processes running target(rank, count, sender, *args); each sends its reports on its pipe.

    A forkserver that has imported torch and spmd once forks them, so each costs milliseconds, not the
    seconds of a fresh interpreter importing torch, and none inherits this process's threads.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "spmd", "spmd.comm.transports.shm.hierarchical", __name__])
    pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
    processes = [ctx.Process(target=target, args=(rank, count, pipes[rank][1], *args), daemon=True)
                 for rank in range(count)]
    for process in processes:
        process.start()
    for _, sender in pipes:
        sender.close()                    # the children hold their own copies
    return processes, _Inbox([reader for reader, _ in pipes])


def _reap(processes: list[multiprocessing.Process]) -> None:
    for process in processes:
        process.join(timeout=20)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _sorted_reports(target: Callable[..., None], count: int, *args: Any) -> list[Any]:
    """Spawn `count` workers running `target`, collect one report from each (sorted), and reap them."""
    processes, results = _spawn(target, count, *args)
    try:
        return sorted(results.get(timeout=90) for _ in range(count))
    finally:
        _reap(processes)


def _kill_worker(rank: int, world_size: int, results: Any, store_path: str) -> None:
    """Check a few collectives across processes, then loop on all_reduce until a peer is killed."""
    torch.set_num_threads(1)
    spmd.init_process_group("shm", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=60)
    try:
        t = torch.full((300_000,), float(rank + 1))
        spmd.all_reduce(t)
        out = torch.empty(3 * 1000, dtype=torch.int64)
        spmd.all_gather_into_tensor(out, torch.full((1000,), rank, dtype=torch.int64))
        p2p = torch.empty(70_000)
        sent = spmd.isend(torch.full((70_000,), float(rank)), (rank + 1) % world_size)
        spmd.recv(p2p, (rank - 1) % world_size)
        sent.wait()
        results.send(("checked", rank, os.getpid(), t[0].item() == 6.0 and torch.equal(
            out, torch.arange(3).repeat_interleave(1000)) and p2p[0].item() == (rank - 1) % world_size))
        big = torch.ones(4 << 20)
        started = None
        try:
            while True:
                spmd.all_reduce(big)
                if started is None:
                    started = time.monotonic()
                    results.send(("looping", rank, os.getpid(), None))
        except Exception as error:   # what the survivors report is the point of the test
            results.send(("failed", rank, type(error).__name__, (time.monotonic(), str(error))))
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_killed_rank_fails_the_survivors_fast_and_leaves_no_segment(tmp_path) -> None:
    processes, results = _spawn(_kill_worker, 3, str(tmp_path / "store"))
    try:
        pids, checked, looping = {}, [], 0
        while looping < 3:
            kind, rank, pid, value = results.get(timeout=90)
            pids[rank] = pid
            checked += [value] if kind == "checked" else []
            looping += kind == "looping"
        assert checked == [True, True, True]
        os.kill(pids[2], signal.SIGKILL)
        killed_at = time.monotonic()
        reports = [results.get(timeout=30) for _ in range(2)]
    finally:
        _reap(processes)
    for kind, rank, error_type, (failed_at, message) in reports:
        assert kind == "failed" and rank in (0, 1)
        assert error_type == "PeerLostError", message
        assert "rank 2 " in message
        assert failed_at - killed_at < 5.0
    assert _segments_of(list(pids.values())) == []


def _leave_in_set_up_window(rank: int, world_size: int, results: Any, how: str) -> None:
    segment = shm_segment.Segment.create(2)     # created, never attached by a peer: the name is still linked
    path = os.path.join(shm_segment.SHM_DIR, segment.name)
    existed = os.path.exists(path)
    if how == "exit":
        atexit._run_exitfuncs()     # what interpreter shutdown runs (multiprocessing children skip it)
    results.send((segment.name, existed, os.path.exists(path)))     # synchronous: in the pipe before any kill
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_set_up_window_names_are_removed_at_exit() -> None:
    processes, results = _spawn(_leave_in_set_up_window, 1, "exit")
    _, existed, exists_after_exit = results.get(timeout=60)
    _reap(processes)
    assert existed and not exists_after_exit                                        # atexit unlinked it


@pytest.mark.timeout(120)
def test_a_segment_of_a_process_killed_in_set_up_is_gone_after_the_next_set_up_without_a_launcher() -> None:
    processes, results = _spawn(_leave_in_set_up_window, 1, "kill")
    name, existed, _ = results.get(timeout=60)
    _reap(processes)
    assert existed                    # SIGKILL: no atexit; its peer never attached, so nobody unlinked it
    assert run_ranks(lambda rank, size: spmd.get_backend(), 2, timeout=60, backend=SHM) == [SHM, SHM]
    assert name not in os.listdir(shm_segment.SHM_DIR)      # that set-up swept it: no sweep called here


def test_orphan_sweep_removes_names_of_dead_or_replaced_creators_of_this_pid_namespace_only(tmp_path) -> None:
    pid = os.getpid()
    start = shm_names.process_start_time(pid)
    namespace = os.stat("/proc/self/ns/pid").st_ino
    live = os.path.basename(shm_names.new_segment_name())
    reused = f"spmd-{pid}-{start + 1}-{namespace}-00"          # our pid, an earlier process's start time
    dead = f"spmd-{2**22 + 1}-5-{namespace}-00"               # above pid_max's default: nobody runs it
    elsewhere = f"spmd-{2**22 + 1}-5-{namespace + 1}-00"      # a container sharing /dev/shm but not our pids
    others = ["spmd-12-notanumber", "spmd-1-2-3", "other-1-2-3-4", live]
    for name in [reused, dead, elsewhere, *others]:
        (tmp_path / name).write_bytes(b"")
    assert sorted(shm_names.remove_orphan_segments(str(tmp_path))) == sorted([reused, dead])
    assert sorted(os.listdir(tmp_path)) == sorted([elsewhere, *others])


def test_orphan_sweep_keeps_live_creators_segments() -> None:
    segment = shm_segment.Segment.create(2)
    try:
        assert segment.name not in shm_names.remove_orphan_segments()
        assert os.path.exists(os.path.join(shm_segment.SHM_DIR, segment.name))
    finally:
        segment.close()
    assert not os.path.exists(os.path.join(shm_segment.SHM_DIR, segment.name))



# -- hierarchical -------------------------------------------------------------------------------------------

def _on_fake_hosts(hosts: tuple[str, ...], fn: Callable[[Transport, int], Any], timeout: float = 60) -> list[Any]:
    """Run fn(transport, group_rank) on one thread per rank, each rank's shm transport built with `hosts`."""
    store = spmd.HashStore(timeout=timeout)
    results: list[Any] = [None] * len(hosts)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        spec = TransportSpec(store=store, group_name="hier", group_rank=rank, global_ranks=tuple(range(len(hosts))),
                             hosts=hosts, timeout=timeout, token=b"t")
        transport = create_transport(SHM, spec)
        try:
            results[rank] = fn(transport, rank)
        except BaseException as error:   # reported below, after the other ranks are released
            errors.append(error)
            transport.abort(error)
        finally:
            transport.close()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(len(hosts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a rank is still running"
    return results


def _refuse(op: str, *args: object) -> None:
    raise AssertionError(f"{op} went over the flat tcp transport, not the hierarchical algorithm")


def _ctx(op: str, seq: int, tensor: torch.Tensor, reduce_op: spmd.ReduceOp | None = None,
         root: int | None = None) -> OpContext:
    fingerprint = Fingerprint(op, seq, tuple(tensor.shape), str(tensor.dtype), reduce_op and reduce_op.name, root)
    return OpContext(fingerprint, Deadline(30.0), "test group")


@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "a", "b"), ("a", "a", "a", "b"),
                                   ("a", "b", "b", "c", "a")])
def test_hierarchical_collectives_equal_the_flat_algorithm(hosts: tuple[str, ...], small_slots: None) -> None:
    n, size = 3001, len(hosts)

    def body(transport: Transport, rank: int) -> list[torch.Tensor]:
        assert isinstance(transport, HierarchicalTransport if len(set(hosts)) > 1 else LocalShmTransport)
        assert transport.name == ("shm+tcp" if len(set(hosts)) > 1 else SHM)
        if isinstance(transport, HierarchicalTransport):        # these never take the flat route
            for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"):
                setattr(transport.flat, name, functools.partial(_refuse, name))
        results = []
        for seq, op in enumerate((spmd.ReduceOp.SUM, spmd.ReduceOp.AVG, spmd.ReduceOp.MAX)):
            t = _inputs(rank, n, torch.float64) * (rank + 1)
            transport.all_reduce(t, op, _ctx("all_reduce", seq, t, op))
            results.append(t)
        for root in range(len(hosts)):
            t = torch.full((n,), float(rank))
            transport.broadcast(t, root, _ctx("broadcast", 10 + root, t, root=root))
            results.append(t)
        transport.barrier(_ctx("barrier", 20, torch.empty(0)))
        out = torch.empty(size * 5, dtype=torch.int32)
        transport.all_gather(out, torch.full((5,), rank, dtype=torch.int32), _ctx("all_gather", 21, out))
        results.append(out)
        mine = _inputs(rank, n, torch.float64) * (rank + 1)
        out = torch.empty(size * n, dtype=torch.float64)
        transport.all_gather(out, mine, _ctx("all_gather", 22, out))
        results.append(out)
        for seq, op in enumerate((spmd.ReduceOp.SUM, spmd.ReduceOp.AVG, spmd.ReduceOp.MAX), start=23):
            full = torch.cat([_inputs(rank + block, n, torch.float64) * (block + 1) for block in range(size)])
            kept = full.clone()
            out = torch.empty(n, dtype=torch.float64)
            transport.reduce_scatter(out, full, op, _ctx("reduce_scatter", seq, full, op))
            assert torch.equal(full, kept), "reduce_scatter changed its input"
            results.append(out)
        for root in range(size):             # (flat over tcp) the root on every host, as its leader or not
            for seq, op in enumerate((spmd.ReduceOp.SUM, spmd.ReduceOp.AVG), start=30 + 4 * root):
                t = _inputs(rank, n, torch.float64) * (rank + 1)
                kept = t.clone()
                transport.reduce(t, root, op, _ctx("reduce", seq, t, op, root))
                assert rank == root or torch.equal(t, kept), "reduce changed a non-root's tensor"
                results.append(t)
            mine = _inputs(rank, n, torch.float64) * (rank + 1)
            out = torch.empty(size * n, dtype=torch.float64) if rank == root else None
            transport.gather(out, mine, root, _ctx("gather", 32 + 4 * root, mine, root=root))
            results.append(out)
            full = torch.cat([_inputs(block, n, torch.float64) * (block + 1) for block in range(size)]) + root
            out = torch.empty(n, dtype=torch.float64)
            transport.scatter(out, full if rank == root else None, root, _ctx("scatter", 33 + 4 * root, out, root=root))
            results.append(out)
        works = []
        for peer in range(len(hosts)):      # to every peer, on this host (shm) or another (tcp)
            work = Work(f"isend to {peer}")
            transport.isend(torch.full((700,), rank * 10.0 + peer), peer, 3, work)
            works.append(work)
        for peer in range(len(hosts)):
            got, work = torch.empty(700), Work(f"irecv from {peer}")
            transport.irecv(got, peer, 3, work)
            work.wait(timeout=30)
            results.append(got)
        for work in works:
            work.wait(timeout=30)
        return results

    hierarchical = _on_fake_hosts(hosts, body)
    hosts = ("a",) * len(hosts)
    flat = _on_fake_hosts(hosts, body)
    for rank, (mine, reference) in enumerate(zip(hierarchical, flat)):
        assert len(mine) == len(reference)
        for got, want in zip(mine, reference):
            assert (got is None and want is None) or torch.equal(got, want), rank
    assert torch.equal(flat[0][0], sum(_inputs(r, n, torch.float64) * (r + 1) for r in range(len(hosts))))
    assert flat[2][5].tolist() == [2.0] * n                                       # broadcast from rank 2
    assert flat[1][size + 3].tolist() == [r for r in range(size) for _ in range(5)]   # all_gather
    assert torch.equal(flat[1][size + 4], torch.cat([_inputs(r, n, torch.float64) * (r + 1) for r in range(size)]))
    for rank in range(size):                                       # reduce_scatter SUM: rank's block summed
        want = sum(_inputs(r + rank, n, torch.float64) * (rank + 1) for r in range(size))
        assert torch.equal(flat[rank][size + 5], want), rank
    assert flat[2][-1].tolist() == [(size - 1) * 10.0 + 2] * 700                  # the last rank sent to rank 2
    everyone = [_inputs(r, n, torch.float64) * (r + 1) for r in range(size)]
    first = size + 8                                                      # rank 1's reduce, gather, scatter
    assert torch.equal(flat[1][first + 4], sum(everyone)) and torch.equal(flat[1][first + 5], sum(everyone) / size)
    assert torch.equal(flat[1][first + 6], torch.cat(everyone)) and flat[0][first + 6] is None
    assert torch.equal(flat[3][first + 7], everyone[3] + 1)


def _two_host_worker(rank: int, world_size: int, results: Any, store_path: str) -> None:
    os.environ["SPMD_HOST_ID"] = "host-a" if rank < 2 else "host-b"     # read by init_process_group
    torch.set_num_threads(1)
    spmd.init_process_group("shm", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=60)
    try:
        engine = type(current_world().default_group.transport).__name__
        t = torch.arange(300_000, dtype=torch.float64) * (rank + 1)
        spmd.all_reduce(t)
        b = torch.full((1000,), float(rank))
        spmd.broadcast(b, src=3)
        out = torch.empty(4 * 10)
        spmd.all_gather_into_tensor(out, torch.full((10,), float(rank)))
        summed, blocks = torch.empty(100_000, dtype=torch.float64), torch.arange(400_000, dtype=torch.float64)
        spmd.reduce_scatter_tensor(summed, blocks * (rank + 1))
        reduced = torch.full((1000,), float(rank))
        spmd.reduce(reduced, dst=3)                       # roots that are not their host's leader
        gathered = [torch.empty(10) for _ in range(4)] if rank == 1 else None
        spmd.gather(torch.full((10,), float(rank)), gathered, dst=1)
        scattered = torch.empty(10)
        spmd.scatter(scattered, [torch.full((10,), r * 2.0) for r in range(4)] if rank == 3 else None, src=3)
        results.send((rank, engine, spmd.get_backend(), torch.equal(t, torch.arange(300_000, dtype=torch.float64) * 10)
                     and b[0].item() == 3.0 and torch.equal(out, torch.arange(4.0).repeat_interleave(10))
                     and torch.equal(summed, blocks[rank * 100_000:(rank + 1) * 100_000] * 10)
                     and (rank != 3 or reduced.tolist() == [6.0] * 1000)
                     and (rank != 1 or torch.equal(torch.cat(gathered), torch.arange(4.0).repeat_interleave(10)))
                     and scattered.tolist() == [rank * 2.0] * 10))
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_hosts_across_processes(tmp_path) -> None:
    reports = _sorted_reports(_two_host_worker, 4, str(tmp_path / "store"))
    assert reports == [(rank, "HierarchicalTransport", "shm+tcp", True) for rank in range(4)]


def _lost_on_other_host_worker(rank: int, world_size: int, results: Any, store_path: str) -> None:
    """Ranks 0-1 on host-a, 2-3 on host-b; rank 3 exits after one all_reduce, the others report their error."""
    os.environ["SPMD_HOST_ID"] = "host-a" if rank < 2 else "host-b"
    torch.set_num_threads(1)
    spmd.init_process_group("shm", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=60)
    t = torch.ones(1000)
    spmd.all_reduce(t)
    if rank == 3:
        results.send((rank, "", ""))
        os._exit(0)
    try:
        spmd.all_reduce(t)
        results.send((rank, "no error", ""))
    except PeerLostError as error:
        results.send((rank, str(error), error.reason))
    finally:
        os._exit(0)


@pytest.mark.timeout(120)
def test_a_peer_lost_on_another_host_is_named_once_with_its_host_on_every_rank(tmp_path) -> None:
    reports = _sorted_reports(_lost_on_other_host_worker, 4, str(tmp_path / "store"))
    host = socket.gethostname()
    for rank, message, reason in reports[:3]:
        assert message.count("spmd: all_reduce") == 1 and message.count(f"rank {rank} on {host}") == 1, message
        assert re.match(rf"rank 3 on {host} \(group rank 1, pid \d+\) died; the group can't continue$", reason)
        # rank 2 saw it (same host); rank 0 heard it from rank 2, rank 1 from rank 0: both name rank 2
        assert message.endswith(reason if rank == 2 else f"{reason} (seen first by rank 2 on {host})"), message


def test_a_rank_that_never_joins_the_set_up_times_out_and_leaves_no_segment() -> None:
    spec = TransportSpec(store=spmd.HashStore(timeout=5), group_name="lonely", group_rank=0, global_ranks=(0, 1),
                         hosts=("h", "h"), timeout=0.5, token=b"t")
    with pytest.raises(CommTimeoutError, match=r"group rank\(s\) \[1\] did not reach the set-up within 0.5s, so no "
                                               r"shared segment was made"):
        create_transport(SHM, spec)
    assert _segments_of([os.getpid()]) == []
