"""The torch:gloo transport: the collective matrix in real processes, subgroups, and the store adapter torch's
groups rendezvous through (timeouts, dead peers and aborts: test_failures.py, which runs them on every transport).

Thread ranks run the full matrix (tests/comm/test_matrix.py lists torch:gloo); here every family also runs on
real rank processes from the shared pool, where each process builds its own gloo groups.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd._core.deadline import Deadline
from spmd._core.errors import PeerLostError
from spmd.comm.debug import Fingerprint
from spmd.comm.store.base import HashStore, PrefixStore
from spmd.comm.transports.base import OpContext
from spmd.comm.transports.torch_pg import SpmdStoreAdapter
from spmd.comm.world import default_group
from spmd.device_mesh import init_device_mesh
from spmd.testing import run_ranks
from tests.comm.test_matrix import FAMILIES, SUBGROUPS
from tests.procpool import ProcPool


def _matrix_family(rank: int, world_size: int, family: str) -> None:
    spmd.init_process_group("torch:gloo", timeout=60)
    try:
        groups: list[tuple[spmd.ProcessGroup | None, list[int]]] = [(None, list(range(world_size)))]
        for ranks in SUBGROUPS[world_size]:
            group = spmd.new_group(ranks)
            if rank in ranks:
                groups.append((group, sorted(ranks)))
        for group, members in groups:
            FAMILIES[family](rank, group, members)
    finally:
        spmd.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_matrix_in_real_processes(procpool: ProcPool, world_size: int, family: str) -> None:
    procpool.run(_matrix_family, world_size, timeout=240, args=(family,))


def test_subgroups_and_mesh_groups_each_get_their_own_torch_group() -> None:
    def body(rank: int, size: int) -> list[float]:
        evens, odds = spmd.new_group([0, 2]), spmd.new_group([1, 3])
        mine = evens if rank % 2 == 0 else odds
        t = torch.full((3,), float(rank))
        spmd.all_reduce(t, group=mine)
        mesh = init_device_mesh("cpu", (2, 2))
        rows = torch.full((2,), float(rank))
        spmd.all_reduce(rows, group=mesh.get_group(1))
        cols = torch.full((2,), float(rank))
        spmd.all_reduce(cols, group=mesh.get_group(0))
        assert mine.backend == "torch:gloo"
        # gloo's backend has no allocator of its own: the group's buffer is a plain one, and it works
        assert mine.transport.allocate_tensor(4, torch.float32, torch.device("cpu")) is None
        buffer = mine.allocate_tensor(4, torch.float32, torch.device("cpu"))
        spmd.all_reduce(buffer.fill_(1.0), group=mine)
        assert buffer.tolist() == [2.0] * 4
        return [t[0].item(), rows[0].item(), cols[0].item()]

    results = run_ranks(body, 4, timeout=60, backend="torch:gloo")
    assert results == [[2.0, 1.0, 2.0], [4.0, 1.0, 4.0], [2.0, 5.0, 2.0], [4.0, 5.0, 4.0]]


def test_store_adapter_serves_torch_groups_from_an_spmd_store() -> None:
    spmd_store = PrefixStore("group/x", HashStore(timeout=5))
    adapter = SpmdStoreAdapter(spmd_store)
    adapter.set("a", b"1")
    assert adapter.get("a") == b"1"
    assert adapter.add("n", 2) == 2 and adapter.add("n", 3) == 5
    assert adapter.compare_set("c", b"", b"v") == b"v"
    assert adapter.check(["a", "c"]) and not adapter.check(["missing"])
    assert adapter.multi_get(["a", "c"]) == [b"1", b"v"]
    assert spmd_store.underlying_store.get("group/x/a") == b"1"     # keys land in spmd's prefixed namespace
    with pytest.raises(Exception, match="missing"):
        adapter.wait(["missing"], datetime.timedelta(seconds=0.1))
    assert adapter.delete_key("a") and not adapter.check(["a"])

    def build(rank: int, out: list[float]) -> None:
        group = dist.ProcessGroupGloo(SpmdStoreAdapter(spmd_store), rank, 2, datetime.timedelta(seconds=20))
        t = torch.full((2,), float(rank + 1))
        group.allreduce([t]).wait()
        out[rank] = t[0].item()

    out = [0.0, 0.0]
    threads = [threading.Thread(target=build, args=(rank, out)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert out == [3.0, 3.0]


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL: the transport builds")
def test_torch_nccl_without_nccl_says_so() -> None:
    with pytest.raises(Exception, match="has no NCCL"):
        spmd.init_process_group("torch:nccl", store=HashStore(timeout=10), rank=0, world_size=1, timeout=10)
    assert not spmd.is_initialized()


class _EndsAsTheSliceRunsOut:
    """A torch Work whose timed wait gives up just as the op ends: the slice's timeout, then completed."""

    def __init__(self, outcome: Exception | None) -> None:
        self.outcome, self.waits = outcome, []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if timeout is not None and len(self.waits) == 1:
            raise RuntimeError("[gloo] Timed out waiting 100ms for the op to complete")
        if self.outcome is not None:
            raise self.outcome
        return True

    def is_completed(self) -> bool:
        return len(self.waits) >= 1


@pytest.mark.parametrize("outcome", [None, RuntimeError("[gloo] Connection closed by peer")])
def test_an_op_that_ends_as_a_wait_slice_runs_out_has_its_own_outcome(outcome: Exception | None) -> None:
    def body(rank: int, size: int) -> str:
        transport = default_group().transport
        ctx = OpContext(Fingerprint("all_reduce", 1, (1,), "float32", "SUM", None), Deadline(60.0), "test group")
        work = _EndsAsTheSliceRunsOut(outcome)
        try:
            transport._wait(work, ctx)
        except PeerLostError as error:            # the op's own failure, not a timeout
            return f"failed: {error}"
        finally:
            assert len(work.waits) == 2 and work.waits[1] is None
        return "completed"

    [result] = run_ranks(body, 1, timeout=60, backend="torch:gloo")
    if outcome is None:
        assert result == "completed"
    else:
        assert result.startswith("failed") and "a peer was lost" in result and "Connection closed" in result


def test_an_op_that_ends_while_a_peers_abort_is_looked_up_keeps_its_own_outcome() -> None:
    """gloo's waits run in slices: a slice runs out, and the op ends while the store is asked whether a peer
    aborted. Its own outcome counts (here: success), not the slice's timeout, which was raised as the op's
    (seen as a flaky matrix test under load)."""
    from spmd.comm.transports.torch_pg import TorchGlooTransport

    class EndsDuringTheLookup:
        def __init__(self) -> None:
            self.checks = 0

        def wait(self, timeout: datetime.timedelta | None = None) -> bool:
            if timeout is not None and self.checks < 2:
                raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out")
            return True

        def is_completed(self) -> bool:
            self.checks += 1
            return self.checks >= 2

    failed: list[BaseException] = []

    class Transport:
        def _peer_abort(self, what: str) -> None:
            return None

        def _translate(self, error: BaseException, what: str, timeout: float) -> BaseException:
            return RuntimeError(f"{what}: {error}")

        def _fail_group(self, error: BaseException) -> None:
            failed.append(error)

    ctx = OpContext(Fingerprint("all_reduce", 6, (1,), "float32", "SUM", None), Deadline(60.0), "test group")
    TorchGlooTransport._wait(Transport(), EndsDuringTheLookup(), ctx)    # type: ignore[arg-type]
    assert failed == []


class _AllOf:
    """One torch Work standing for several (what a coalescing backend's _end_coalescing returns)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return all(work.wait() for work in self.works)


class _CoalescingGloo:
    """torch's gloo group, made to coalesce as NCCL does: the sends and receives between _start_coalescing and
    _end_coalescing are logged and run, and the end returns one Work for them all; a send or receive outside a
    batch is refused, so a batch started message by message would fail."""

    supports_coalescing = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.log = group, []
        self._batch: list[dist.Work] | None = None

    def _start_coalescing(self) -> None:
        self.log.append("start")
        self._batch = []

    def _message(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        assert self._batch is not None, f"{kind} outside a coalesced batch"
        self.log.append((kind, peer))
        self._batch.append(getattr(self.group, kind)(tensors, peer, tag))

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self._message("send", tensors, peer, tag)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self._message("recv", tensors, peer, tag)

    def _end_coalescing(self) -> _AllOf:
        self.log.append("end")
        works, self._batch = self._batch or [], None
        return _AllOf(works)

    def __getattr__(self, name: str) -> object:
        return getattr(self.group, name)


def test_batch_isend_irecv_coalesces_on_a_backend_that_coalesces() -> None:
    """NCCL's large sends wait for their receives, so two ranks that each send before they receive hang unless
    the batch is one coalesced group (torch's batch_isend_irecv); messages to the rank itself stay spmd's."""
    def body(rank: int, size: int) -> tuple[list, list[float], list[float]]:
        transport = default_group().transport
        transport._pg = _CoalescingGloo(transport._pg)
        peer = 1 - rank
        got, mine = torch.zeros(4), torch.zeros(2)
        works = spmd.batch_isend_irecv([
            spmd.P2POp(spmd.isend, torch.full((4,), float(rank)), peer),
            spmd.P2POp(spmd.isend, torch.full((2,), rank + 10.0), rank),
            spmd.P2POp(spmd.irecv, got, peer),
            spmd.P2POp(spmd.irecv, mine, rank)])
        for work in works:
            work.wait()
        return transport._pg.log, got.tolist(), mine.tolist()

    for rank, (log, got, mine) in enumerate(run_ranks(body, 2, timeout=60, backend="torch:gloo")):
        assert log == ["start", ("send", 1 - rank), ("recv", 1 - rank), "end"]
        assert got == [float(1 - rank)] * 4 and mine == [rank + 10.0] * 2
