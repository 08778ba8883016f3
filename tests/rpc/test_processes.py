"""spmd.rpc in real processes, rendezvousing by themselves (no spmd world: init_rpc's own, over the file store):
calls, a 12 MiB tensor (copied out of the sender's memory where the kernel lets the receiver read it) and an RRef
work across processes, and a worker SIGKILLed while another waits on its call fails that call
fast, naming the lost worker, the survivor's later calls to it fail the same way, and its graceful shutdown does
not wait for the dead worker; a call whose large tensor waits for a worker that is alive but stopped (by
reference, or by value past what its socket buffers) fails at its timeout, and the worker, resumed, serves the
next call; a response whose large tensor waits for a caller that
is stopped frees its server thread at the server's rpc_timeout, and the caller, resumed, still gets it; a thread
the user starts calls through its process's agent; a worker whose main thread fails exits though a handler of its
still waits, and its caller's call fails naming it."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import spmd.rpc as rpc
from tests.comm.test_shm import _reap, _spawn


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _scale(x: torch.Tensor, by: float) -> torch.Tensor:
    return x * by


def _worker(rank: int, world_size: int, results: Any, store: str) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", rpc_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 1:
        rpc.rpc_sync("w0", _scale, (torch.ones(2), 1.0))    # it serves until it is killed (below)
        while True:
            time.sleep(60)
    report: dict[str, Any] = {"scaled": rpc.rpc_sync("w1", _scale, (torch.arange(3.0), 2.0)).tolist()}
    large = torch.arange(3 << 20, dtype=torch.float32)       # 12 MiB: read from this process's memory, and back
    report["large"] = torch.equal(rpc.rpc_sync("w1", _scale, (large, 2.0)), large * 2)
    report["rref"] = rpc.remote("w1", _scale, (torch.ones(2), 3.0)).to_here().tolist()
    started = time.monotonic()
    for attempt in ("dying", "after"):
        try:
            rpc.rpc_sync("w1", _die)
        except RuntimeError as error:
            report[attempt] = str(error)
    report["seconds"] = time.monotonic() - started
    rpc.shutdown()                              # graceful: it does not wait for the dead worker
    report["shutdown_seconds"] = time.monotonic() - started - report["seconds"]
    results.send(report)


@pytest.mark.timeout(120)
def test_calls_across_processes_and_a_killed_worker_fails_its_calls_naming_it(tmp_path) -> None:
    processes, inbox = _spawn(_worker, 2, str(tmp_path / "store"))
    try:
        report = inbox.get(timeout=90)
    finally:
        _reap(processes)
    assert processes[1].exitcode == -signal.SIGKILL
    assert report["scaled"] == [0.0, 2.0, 4.0] and report["rref"] == [3.0, 3.0]
    assert report["large"]
    for attempt in ("dying", "after"):
        assert "rpc_async(_die) on worker w1 (rank 1) failed" in report[attempt], report[attempt]
    assert report["seconds"] < 30 and report["shutdown_seconds"] < 30, report


_HANDLER_WAITING = threading.Event()
_MAIN_DONE = threading.Event()


def _wait_for_main() -> int:
    _HANDLER_WAITING.set()
    _MAIN_DONE.wait()           # never set: the main thread fails first
    return 1


def _main_fails_while_its_handler_waits(rank: int, world_size: int, results: Any, store: str) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", rpc_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        _HANDLER_WAITING.wait()
        raise RuntimeError("the root cause, on w0")
    try:
        rpc.rpc_sync("w0", _wait_for_main)
    except RuntimeError as error:
        results.send(str(error))
    rpc.shutdown()


@pytest.mark.timeout(120)
def test_a_worker_whose_main_thread_fails_exits_while_a_handler_still_waits(tmp_path) -> None:
    # pytorch/examples' rpc/batch/reinforce: the agent's handlers wait on an event its main thread sets; when that
    # thread failed, the interpreter waited for the handler threads at exit, and the job hung with no error
    processes, inbox = _spawn(_main_fails_while_its_handler_waits, 2, str(tmp_path / "store"))
    try:
        report = inbox.get(timeout=90)
        processes[0].join(timeout=30)
        exitcode = processes[0].exitcode
    finally:
        _reap(processes)
    assert exitcode == 1
    assert "rpc_async(_wait_for_main) on worker w0 (rank 0) failed" in report, report


def _from_a_thread_of_its_own(rank: int, world_size: int, results: Any, store: str) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        found: list[Any] = []
        thread = threading.Thread(target=lambda: found.append(rpc.rpc_sync("w1", _scale, (torch.ones(1), 5.0))))
        thread.start()
        thread.join()
        results.send(found[0].tolist())
    rpc.shutdown()


@pytest.mark.timeout(120)
def test_a_thread_the_user_starts_calls_through_the_processs_agent(tmp_path) -> None:
    processes, inbox = _spawn(_from_a_thread_of_its_own, 2, str(tmp_path / "store"))
    try:
        assert inbox.get(timeout=90) == [5.0]
    finally:
        _reap(processes)


def _scale_all(x: torch.Tensor | list[torch.Tensor], by: float) -> torch.Tensor | list[torch.Tensor]:
    return x * by if isinstance(x, torch.Tensor) else [t * by for t in x]


def _pid() -> int:
    return os.getpid()


def _stopped_peer(rank: int, world_size: int, results: Any, store: str) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", rpc_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        from spmd.rpc.api import _agent

        report: dict[str, Any] = {"by_reference": 1 in _agent.get().channels.reads_me}
        peer = rpc.rpc_sync("w1", _pid)
        large = torch.arange(3 << 20, dtype=torch.float32)     # 12 MiB: by reference, acknowledged once read
        # 16 x 960 KiB: each by value (under 1 MiB), together more than the sockets' 4 MiB buffers hold
        medium = [torch.arange(240 << 10, dtype=torch.float32) + i for i in range(16)]
        os.kill(peer, signal.SIGSTOP)
        for how, tensor in (("by reference", large), ("by value", medium)):
            started = time.monotonic()
            try:
                rpc.rpc_sync("w1", _scale_all, (tensor, 2.0), timeout=1.0)
            except TimeoutError as error:
                report[f"error {how}"] = str(error)
            report[f"seconds {how}"] = time.monotonic() - started
        os.kill(peer, signal.SIGCONT)
        report["after"] = all(torch.equal(rpc.rpc_sync("w1", _scale, (t, 3.0)), t * 3) for t in (large, *medium))
        results.send(report)
    rpc.shutdown()


def _reports_resuming_the_stopped(target: Any, tmp_path: Any, count: int) -> list[dict[str, Any]]:
    """Run `target` on 2 processes and take `count` reports; whatever happens, resume any process the test
    stopped before reaping them."""
    processes, inbox = _spawn(target, 2, str(tmp_path / "store"))
    try:
        return [inbox.get(timeout=90) for _ in range(count)]
    finally:
        for process in processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
        _reap(processes)


@pytest.mark.timeout(120)
def test_calls_to_a_stopped_worker_fail_at_their_timeout_and_the_resumed_worker_serves_the_next(tmp_path) -> None:
    (report,) = _reports_resuming_the_stopped(_stopped_peer, tmp_path, 1)
    assert report["by_reference"], "this host's kernel lets no worker read another's memory: nothing to test"
    for how in ("by reference", "by value"):
        error = report.get(f"error {how}", "")
        assert "_scale_all" in error and "w1" in error and "past its timeout" in error, report
        assert report[f"seconds {how}"] < 10, report
    assert report["after"], report


_CALLER_STOPPED = threading.Event()
_STOPPED_PIDS: list[int] = []


def _stop_my_caller_then_answer_large(caller: int) -> torch.Tensor:
    os.kill(caller, signal.SIGSTOP)
    _STOPPED_PIDS.append(caller)
    _CALLER_STOPPED.set()
    return torch.arange(3 << 20, dtype=torch.float32)      # by reference: its ack waits for the stopped caller


def _stopped_caller(rank: int, world_size: int, results: Any, store: str) -> None:
    # the server answers on its one pool thread and gives a response 1 s to be taken
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", num_worker_threads=1,
                                              rpc_timeout=1 if rank == 0 else 60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 1:
        answer = rpc.rpc_async("w0", _stop_my_caller_then_answer_large, (os.getpid(),))
        results.send({"answer": torch.equal(answer.wait(), torch.arange(3 << 20, dtype=torch.float32))})
    else:
        assert _CALLER_STOPPED.wait(60)
        started = time.monotonic()
        try:       # served by the pool's one thread: free once the response's wait reached its bound
            report: dict[str, Any] = {"served": rpc.rpc_sync("w0", _pid, timeout=30) == os.getpid()}
        except TimeoutError as error:
            report = {"served": False, "error": str(error)}
        report["seconds"] = time.monotonic() - started
        os.kill(_STOPPED_PIDS[0], signal.SIGCONT)
        results.send(report)
    rpc.shutdown()


@pytest.mark.timeout(120)
def test_a_response_to_a_stopped_caller_frees_its_server_thread_and_reaches_the_resumed_caller(tmp_path) -> None:
    reports = _reports_resuming_the_stopped(_stopped_caller, tmp_path, 2)
    server = next(report for report in reports if "served" in report)
    caller = next(report for report in reports if "answer" in report)
    assert server["served"] and server["seconds"] < 10, server
    assert caller["answer"], caller
