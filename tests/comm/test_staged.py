"""An accelerator's tensors over spmd's own host transports, copied through host memory (transports/staged.py).

This machine has no accelerator, so the copies are checked with CPU tensors staged like an accelerator's: the
staged transports here copy every tensor into a fresh host tensor and back, and the collective matrix (every
op, values checked) runs through them, so a missing copy in or out shows as a wrong value. Which transports get
wrapped on a machine with an accelerator is checked with torch.accelerator patched to report one.
"""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd.comm.torch_backend import SpmdProcessGroup
from spmd.comm.transports import base
from spmd.comm.transports.shm.local import LocalShmTransport
from spmd.comm.transports.staged import HostStagedTransport
from spmd.comm.transports.threads import ThreadsTransport
from spmd.comm.world import default_group
from spmd.testing import run_ranks
from tests.comm.test_matrix import FAMILIES, run_matrix
from tests.procpool import ProcPool


class _Recording(ThreadsTransport):
    """The threads transport, keeping the storage of every tensor handed to it."""

    def __init__(self, spec: base.TransportSpec) -> None:
        super().__init__(spec)
        self.handed: set[int] = set()

    def all_reduce(self, tensor: torch.Tensor, op: spmd.ReduceOp, ctx: base.OpContext) -> None:
        self.handed.add(tensor.data_ptr())
        super().all_reduce(tensor, op, ctx)


class StagedThreads(HostStagedTransport):
    """Threads ranks whose CPU tensors are staged as an accelerator's would be."""

    def __init__(self, spec: base.TransportSpec) -> None:
        super().__init__(_Recording(spec), ("cpu",))


class StagedShm(HostStagedTransport):
    """The shared-memory transport (whose receives a waiter drives through Work.poll), staged likewise."""

    def __init__(self, spec: base.TransportSpec) -> None:
        super().__init__(LocalShmTransport(spec), ("cpu",))


@pytest.fixture(autouse=True)
def staged_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(base._TRANSPORTS, "staged-threads", f"{__name__}:StagedThreads")
    monkeypatch.setitem(base._TRANSPORTS, "staged-shm", f"{__name__}:StagedShm")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matrix_through_host_copies(family: str) -> None:
    run_matrix("staged-threads", 4, FAMILIES[family])      # 4 ranks: the default group and three subgroups


@pytest.mark.parametrize("family", ["all_reduce", "all_gather", "p2p"])
def test_shm_matrix_through_host_copies(family: str) -> None:
    run_matrix("staged-shm", 2, FAMILIES[family])


@pytest.mark.timeout(60)
def test_the_host_transport_gets_copies_and_the_caller_the_result() -> None:
    def fn(rank: int, size: int) -> tuple[bool, list[float]]:
        tensor = torch.full((4,), float(rank + 1))
        spmd.all_reduce(tensor)
        work = spmd.all_reduce(tensor, async_op=True)
        work.wait()
        transport = default_group().transport
        assert isinstance(transport, HostStagedTransport)
        return tensor.data_ptr() in transport.host.handed, tensor.tolist()

    assert run_ranks(fn, 2, timeout=60, backend="staged-threads") == [(False, [6.0] * 4)] * 2


@pytest.mark.timeout(60)
def test_a_receive_posted_before_its_send_completes_through_the_copy() -> None:
    """The receive's host Work completes on the sender's delivery; the caller's Work only after the copy."""
    def fn(rank: int, size: int) -> list[float]:
        if rank == 0:
            tensor = torch.zeros(3)
            work = spmd.irecv(tensor, src=1)
            spmd.barrier()                  # the receive is posted before rank 1 sends
            work.wait()
            return tensor.tolist()
        spmd.barrier()
        spmd.send(torch.arange(3.0), dst=0)
        return []

    assert run_ranks(fn, 2, timeout=60, backend="staged-shm")[0] == [0.0, 1.0, 2.0]


def _receive_in_processes(rank: int, size: int) -> tuple[bool, list[float]]:
    base._TRANSPORTS["staged-shm"] = f"{__name__}:StagedShm"
    spmd.init_process_group("staged-shm", timeout=30)
    try:
        if rank == 0:
            tensor = torch.zeros(3)
            work = spmd.irecv(tensor, src=1)
            spmd.barrier()
            forwarded = work.poll is not None
            work.wait()
            return forwarded, tensor.tolist()
        spmd.barrier()
        spmd.send(torch.arange(3.0), dst=0)
        return False, []
    finally:
        spmd.destroy_process_group()
        del base._TRANSPORTS["staged-shm"]


@pytest.mark.timeout(120)
def test_a_waiter_in_its_own_process_moves_a_staged_receive(procpool: ProcPool) -> None:
    """Between processes the shm transport lets the waiting thread pull a message (Work.poll): the caller's
    Work of a staged receive hands that on, and the message reaches the caller's tensor."""
    assert procpool.run(_receive_in_processes, 2, timeout=90)[0] == (True, [0.0, 1.0, 2.0])


@pytest.fixture
def an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.accelerator reports a CUDA device (transports are only built here, no CUDA tensor made)."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("an_accelerator")
@pytest.mark.parametrize(("backend", "staged"), [
    ("threads", True), ("gloo", True), ("shm", True), ("tcp", True), ("torch:gloo", False)])
def test_spmds_host_transports_stage_an_accelerators_tensors_and_torchs_gloo_does_not(backend: str,
                                                                                        staged: bool) -> None:
    def fn(rank: int, size: int) -> tuple[tuple[str, ...], str, str]:
        group = default_group()
        return group.transport.devices, spmd.get_backend(), SpmdProcessGroup(group)._get_backend_name()

    devices, name, torch_name = run_ranks(fn, 2, timeout=60, backend=backend)[0]
    assert devices == (("cpu", "cuda") if staged else ("cpu",))
    assert name == {"threads": "threads", "gloo": "gloo", "shm": "shm", "tcp": "tcp", "torch:gloo": "torch:gloo"}[
        backend]
    assert torch_name == "gloo"      # torch's code asks it to tell a host group: staging keeps the answer


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("an_accelerator")
def test_a_device_map_stages_only_the_accelerators_entry() -> None:
    """torch takes "cuda:gloo" (gloo serving CUDA tensors); a "cpu:..." entry stays a host transport."""
    def fn(rank: int, size: int) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        transport = default_group().transport
        return transport.devices, [sub.devices for sub in transport._by_device.values()]

    assert run_ranks(fn, 2, timeout=60, backend="cpu:gloo,cuda:gloo")[0] == (("cpu", "cuda"),
                                                                             [("cpu",), ("cpu", "cuda")])
