"""Expiration timers (spmd.elastic.timer, torch's elastic.timer): a worker whose `expires` block outlives its
deadline is killed by the timer server beside it; one that leaves in time, or releases, is not. Under spmdrun with
TORCHELASTIC_ENABLE_FILE_TIMER=1 the agent serves the timers, names the rank and the block, and restarts the job.
torch's own FileTimerClient talks to spmd's server."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.elastic.timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    LocalTimerClient,
    LocalTimerServer,
    expires,
)
from tests.run.helpers import run_agent
from tests.run.test_launcher import script

_CHILD = """
import sys, time
if sys.argv[2] == "torch":
    from torch.distributed.elastic.timer import FileTimerClient, expires
else:
    from spmd.elastic.timer import FileTimerClient, expires
client = FileTimerClient(sys.argv[1])
with expires(after=float(sys.argv[3]), scope=sys.argv[4], client=client):
    time.sleep(float(sys.argv[5]))
print("left in time", flush=True)
"""


@pytest.mark.timeout(120)
def test_the_file_server_kills_the_worker_past_its_deadline_and_spares_the_one_that_left(tmp_path: Path) -> None:
    events: list[tuple[str, FileTimerRequest | None]] = []
    server = FileTimerServer(str(tmp_path / "timer.fifo"), "job", max_interval=0.05,
                             log_event=lambda name, request: events.append((name, request)))
    server.start()
    try:
        fd = os.open(tmp_path / "timer.fifo", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"not a request\n")      # a stranger's line: reported, and the rest still served
        os.close(fd)
        children = {name: subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "timer.fifo"), *args],
                                           stdout=subprocess.PIPE, text=True)
                    for name, args in {"stuck": ("spmd", "1.5", "stuck loader", "120"),
                                       "in time": ("spmd", "60", "quick step", "0"),
                                       "torch's client": ("torch", "1.5", "torch scope", "120")}.items()}
        codes = {name: child.wait(timeout=90) for name, child in children.items()}
        outputs = {name: child.stdout.read() for name, child in children.items()}
    finally:
        server.stop()
    assert codes == {"stuck": -signal.SIGKILL, "in time": 0, "torch's client": -signal.SIGKILL}, outputs
    assert "left in time" in outputs["in time"]
    expired = {request.scope_id: request.worker_pid for name, request in events if name == "timer expired"}
    assert expired == {"stuck loader": children["stuck"].pid, "torch scope": children["torch's client"].pid}
    assert any(name.startswith("unreadable request b'not a request'") for name, _ in events), events
    assert not (tmp_path / "timer.fifo").exists()


def _hang_under_a_local_timer(requests: multiprocessing.Queue) -> None:
    with expires(after=0.5, scope="local", client=LocalTimerClient(requests)):
        time.sleep(120)


@pytest.mark.timeout(120)
def test_the_local_server_kills_the_worker_past_its_deadline() -> None:
    context = multiprocessing.get_context("spawn")
    requests = context.Queue()
    server = LocalTimerServer(requests, max_interval=0.05)
    server.start()
    try:
        worker = context.Process(target=_hang_under_a_local_timer, args=(requests,), daemon=True)
        worker.start()
        worker.join(timeout=90)
    finally:
        server.stop()
    assert worker.exitcode == -signal.SIGKILL


def test_a_timer_needs_a_client_and_a_client_needs_a_server(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"no timer client; call spmd\.elastic\.timer\.configure"):
        with expires(after=1):
            pass
    os.mkfifo(tmp_path / "nobody.fifo")
    with pytest.raises(RuntimeError, match="no timer server reads"):
        FileTimerClient(str(tmp_path / "nobody.fifo")).acquire("scope", time.time() + 1)


@pytest.mark.timeout(180)
def test_spmdrun_serves_the_timers_names_the_stuck_rank_and_restarts(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    worker = script(tmp_path, "stuck.py", """
        import os, time
        from spmd.elastic.timer import FileTimerClient, configure, expires
        configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        stuck = os.environ["RANK"] == "1" and os.environ["RESTART_COUNT"] == "0"
        with expires(after=2, scope="stuck data loader" if stuck else "data loader"):
            time.sleep(120 if stuck else 0)
        print("done", flush=True)
    """)
    code, out, err = run_agent("--nproc-per-node", "2", "--max-restarts", "1", worker)
    assert code == 0, err
    assert "worker rank 1 (pid" in err and "its timer for 'stuck data loader' expired; killing it with SIGKILL" \
        in err, err
    assert "signal SIGKILL" in err and "(restart 1 of 1)" in err
    assert out.count("[rank1]: done") == 1 and out.count("[rank0]: done") == 2, out
