"""spmd.run.spawn: the environment children get, and failures reported like spmdrun's (rank, signal, traceback).

Each child is a fresh interpreter that imports spmd (and so torch): a few seconds each, so nprocs stays small.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from spmd.run import ProcessExitedException, ProcessRaisedException, spawn
from tests.run.helpers import is_alive, wait_until

pytestmark = pytest.mark.timeout(120)


def record_env(index: int, out_dir: str) -> None:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    Path(out_dir, f"{index}.tmp").write_text(" ".join([*(os.environ[key] for key in keys), str(os.getpid())]))
    os.replace(Path(out_dir, f"{index}.tmp"), Path(out_dir, str(index)))


def record_then_raise_on_one(index: int, out_dir: str) -> None:
    record_env(index, out_dir)
    if index == 1:
        wait_until(lambda: os.path.exists(os.path.join(out_dir, "0")), 60, "rank 0's record")
        raise ValueError("boom")
    time.sleep(120)


def die_by_signal(index: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_spawn_gives_the_launcher_environment_and_reports_a_raise_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(ProcessRaisedException) as caught:
        spawn(record_then_raise_on_one, args=(str(tmp_path),), nprocs=2)
    records = [(tmp_path / str(index)).read_text().split() for index in range(2)]
    assert [record[:4] for record in records] == [["0", "0", "2", "127.0.0.1"], ["1", "1", "2", "127.0.0.1"]]
    assert records[0][4] == records[1][4] and int(records[0][4]) > 0  # one MASTER_PORT
    error = caught.value
    assert error.error_index == 1
    message = str(error)
    assert "rank 1 (local rank 1)" in message and "raised ValueError: boom" in message
    assert 'raise ValueError("boom")' in message and "in record_then_raise_on_one" in message
    assert "_child" not in message  # the user's frames only
    survivor = int(records[0][5])
    wait_until(lambda: not is_alive(survivor), 10, "the other child to be stopped")


def test_spawn_success_returns_none_and_join_false_gives_a_context(tmp_path: Path) -> None:
    context = spawn(record_env, args=(str(tmp_path),), nprocs=1, join=False)
    assert context is not None and len(context.pids()) == 1
    wait_until(lambda: context.join(timeout=0.1), 60, "the child to end")
    assert (tmp_path / "0").read_text().split()[:3] == ["0", "0", "1"]


def test_spawn_child_killed_by_signal() -> None:
    with pytest.raises(ProcessExitedException) as caught:
        spawn(die_by_signal, nprocs=1)
    assert caught.value.signal_name == "SIGKILL" and caught.value.exit_code == -signal.SIGKILL
    assert "signal SIGKILL" in str(caught.value) and "no Python traceback" in str(caught.value)


def test_spawn_rejects_zero_processes() -> None:
    with pytest.raises(ValueError, match="nprocs must be at least 1"):
        spawn(record_env, nprocs=0)


def record_then_wait(index: int, out_dir: str, ignore_sigterm: bool) -> None:
    if ignore_sigterm and index == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record_env(index, out_dir)
    time.sleep(120)    # stands for a long training run; the test stops it


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_terminate_stops_every_child_and_kills_one_that_ignores_sigterm(tmp_path: Path,
                                                                          ignore_sigterm: bool) -> None:
    context = spawn(record_then_wait, args=(str(tmp_path), ignore_sigterm), nprocs=2, join=False)
    assert context is not None
    wait_until(lambda: all((tmp_path / str(i)).exists() for i in range(2)), 60, "both children's records")
    pids = context.pids()
    started = time.monotonic()
    context.terminate()
    assert not any(is_alive(pid) for pid in pids)
    codes = [process.exitcode for process in context.processes]
    assert codes == ([-signal.SIGTERM, -signal.SIGKILL] if ignore_sigterm else [-signal.SIGTERM] * 2)
    assert (time.monotonic() - started >= 4.0) == ignore_sigterm   # SIGKILL only after the grace period
