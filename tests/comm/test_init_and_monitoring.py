"""What a user meets first and no other test chose: the default backend ("auto"), `init_method="tcp://"`,
`monitored_barrier`, and `Work.exception`.

"auto" and tcp:// run in real processes (ranks of one host, so "auto" must pick shared memory, and tcp:// must
rendezvous through the TCPStore at the given address); the rest on the threads transport.
"""

from __future__ import annotations

import threading

import pytest
import torch

import spmd
from spmd._core.errors import CommTimeoutError
from spmd.comm.transports.base import resolve_backend
from spmd.comm.world import default_group
from spmd.testing import run_ranks
from tests.procpool import ProcPool, free_port


def _init_and_sum(rank: int, world_size: int, backend: str | None, init_method: str | None) -> tuple:
    kwargs = {"init_method": init_method} if init_method else {}
    if backend is None:
        spmd.init_process_group(**kwargs)       # the default backend, as `make demo` uses it
    else:
        spmd.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    try:
        t = torch.full((1000,), float(rank + 1))
        spmd.all_reduce(t)
        return spmd.get_rank(), spmd.get_world_size(), spmd.get_backend(), default_group().transport.name, t[0].item()
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_default_backend_is_auto_and_picks_shared_memory_on_one_host(procpool: ProcPool) -> None:
    results = procpool.run(_init_and_sum, 2, timeout=90, args=(None, None))   # env:// from the pool's env
    assert results == [(0, 2, "shm", "shm", 3.0), (1, 2, "shm", "shm", 3.0)]   # get_backend names the resolved one


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_init_method_tcp_rendezvous_at_the_given_address(procpool: ProcPool, backend: str) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    results = procpool.run(_init_and_sum, 3, timeout=90, args=(backend, url))
    transport = "tcp" if backend == "tcp" else "shm"
    assert results == [(rank, 3, transport, transport, 6.0) for rank in range(3)]


def test_auto_picks_shm_when_ranks_share_a_host_and_tcp_when_each_is_alone() -> None:
    assert resolve_backend("auto", ("a", "a")) == "shm"
    assert resolve_backend("auto", ("a", "b", "b")) == "shm"    # hierarchical: shm inside b, tcp across
    assert resolve_backend("auto", ("a",)) == "shm"
    assert resolve_backend("auto", ("a", "b")) == "tcp"
    with pytest.raises(ValueError, match="unknown backend 'nccl2'"):
        resolve_backend("nccl2", ("a",))


def test_monitored_barrier_returns_when_every_rank_arrives() -> None:
    def body(rank: int, world_size: int) -> int:
        for _ in range(3):
            spmd.monitored_barrier(timeout=20.0)
        return rank

    assert run_ranks(body, world_size=3, timeout=30) == [0, 1, 2]


def test_monitored_barrier_returns_on_the_first_rank_only_after_the_others_read_its_verdict() -> None:
    """The first rank may host the store and leave right after the barrier (under spmdrun it did, and a rank
    still reading the verdict lost the store). Rank 1's read of the verdict waits up to 2 s for rank 0 to
    return: it must time out, rank 0 returning only after the read."""
    order: list[str] = []
    returned = threading.Event()

    def body(rank: int, world_size: int) -> None:
        store = default_group().store
        if rank == 1:
            get = store.get

            def late_get(key: str) -> bytes:
                if key.endswith("/verdict"):
                    returned.wait(timeout=2.0)
                    order.append("rank 1 read the verdict")
                return get(key)

            store.get = late_get
        spmd.monitored_barrier(timeout=20.0)
        if rank == 0:
            order.append("rank 0 returned")
            returned.set()

    run_ranks(body, world_size=2, timeout=30)
    assert order == ["rank 1 read the verdict", "rank 0 returned"]


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_names_the_ranks_that_never_arrived(wait_all_ranks: bool) -> None:
    def body(rank: int, world_size: int) -> str:
        if rank in (1, 3):
            return "absent"                    # ranks 1 and 3 never call it
        if rank == 0:
            # Enter after rank 2 has (its arrival key is set): rank 2's wait for the verdict then starts first,
            # and must still outlast rank 0's timeout to hear which ranks were missing.
            default_group().store.wait(["monitored_barrier/1/arrived/2"], timeout=20.0)
        try:
            spmd.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all_ranks)
        except CommTimeoutError as error:
            return str(error)
        return "passed"

    results = run_ranks(body, world_size=4, timeout=30)
    missing = "[1, 3]" if wait_all_ranks else "[1]"
    for rank in (0, 2):    # rank 0 checks the arrivals; rank 2 hears its verdict
        assert f"ranks {missing} did not reach monitored_barrier #1" in results[rank], results[rank]
        assert f"rank {rank}" in results[rank]


def test_work_exception_is_none_on_success_and_the_error_after_a_failure() -> None:
    def body(rank: int, world_size: int) -> tuple:
        ok = spmd.all_reduce(torch.ones(4), async_op=True)
        ok.wait()
        if rank == 1:
            return ok.exception(), None, None
        failing = spmd.all_reduce(torch.ones(4), async_op=True)   # rank 1 never joins: times out
        with pytest.raises(CommTimeoutError) as raised:
            failing.wait()
        return ok.exception(), failing.exception(), raised.value

    results = run_ranks(body, world_size=2, timeout=30, comm_timeout=0.5)
    assert results[1] == (None, None, None)
    ok_error, failing_error, raised = results[0]
    assert ok_error is None
    assert failing_error is raised and "all_reduce #2" in str(raised)


def test_monitored_barrier_without_its_first_rank_names_that_rank() -> None:
    def body(rank: int, world_size: int) -> str:
        if rank == 0:
            return "absent"
        with pytest.raises(CommTimeoutError) as raised:
            spmd.monitored_barrier(timeout=0.3)
        return str(raised.value)

    for message in run_ranks(body, world_size=3, timeout=30)[1:]:
        assert "rank 0 did not release the barrier" in message, message
