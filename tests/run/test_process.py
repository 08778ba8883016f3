"""WorkerGroup: whole-line rank-prefixed output, per-rank log files, failure records, and process-tree stops.

Workers here are tiny `python -c` programs that do not import torch, so each starts in well under a second.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest

from spmd.run.failure import WorkerFailure, describe_exit, format_summary, read_error_file
from spmd.run.process import Console, WorkerGroup, WorkerSpec, _Prefixer
from tests.run.helpers import is_alive, wait_until

pytestmark = pytest.mark.timeout(60)


def start_group(specs: list[WorkerSpec], console: Console, host: str) -> WorkerGroup:
    group = WorkerGroup(console, host)
    group.start(specs)
    return group


def spec(rank: int, code: str, tmp_path, **kwargs) -> WorkerSpec:
    return WorkerSpec(rank=rank, local_rank=rank, argv=(sys.executable, "-c", code), env=dict(os.environ),
                      error_file=str(tmp_path / f"err{rank}.json"), **kwargs)


def test_lines_are_prefixed_and_never_interleaved(tmp_path) -> None:
    # Each line is written in three flushed pieces; the pumps must still emit it whole.
    code = ("import sys\n"
            "for i in range(200):\n"
            "    for piece in ('a' * 300, 'b' * 300, f' {i}\\n'):\n"
            "        sys.stdout.write(piece); sys.stdout.flush()\n"
            "sys.stdout.write('no newline at the end')\n")
    out, err = io.BytesIO(), io.BytesIO()
    group = start_group([spec(rank, code, tmp_path) for rank in range(3)], Console(out, err), "h")
    wait_until(lambda: all(code is not None for code in group.poll()), 30, "the writers to finish")
    group.stop(grace=1.0)
    lines = out.getvalue().decode().splitlines()
    assert len(lines) == 3 * 201
    for rank in range(3):
        mine = [line for line in lines if line.startswith(f"[rank{rank}]: ")]
        assert mine[:200] == [f"[rank{rank}]: {'a' * 300}{'b' * 300} {i}" for i in range(200)]
        assert mine[200] == f"[rank{rank}]: no newline at the end"


def test_log_files_get_raw_lines_and_console_can_be_muted(tmp_path) -> None:
    code = "import sys; print('to out'); print('to err', file=sys.stderr)"
    out, err = io.BytesIO(), io.BytesIO()
    logs = [tmp_path / "0" / "stdout.log", tmp_path / "0" / "stderr.log"]
    worker = spec(0, code, tmp_path, stdout_log=str(logs[0]), stderr_log=str(logs[1]), stdout_to_console=False)
    group = start_group([worker], Console(out, err), "h")
    wait_until(lambda: group.poll() == [0], 30, "the worker to finish")
    group.stop(grace=1.0)
    assert logs[0].read_text() == "to out\n" and logs[1].read_text() == "to err\n"
    assert out.getvalue() == b"" and err.getvalue() == b"[rank0]: to err\n"


def test_stop_kills_the_whole_tree_even_when_sigterm_is_ignored(tmp_path) -> None:
    # The worker ignores SIGTERM and starts a grandchild (which would survive a plain kill of the worker).
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n")
    out = io.BytesIO()
    group = start_group([spec(0, code, tmp_path)], Console(out, io.BytesIO()), "h")
    wait_until(lambda: out.getvalue().endswith(b"\n"), 30, "the grandchild's pid")
    grandchild = int(out.getvalue().decode().split(": ")[1])
    worker_pid = group.workers[0].pid
    started = time.monotonic()
    group.stop(signal.SIGTERM, grace=0.5)
    assert time.monotonic() - started < 10
    assert group.poll() == [-signal.SIGKILL]  # SIGTERM was ignored, so the escalation did it
    wait_until(lambda: not is_alive(grandchild), 10, "the grandchild to die")
    assert not is_alive(worker_pid)


def test_failures_read_exit_status_and_error_file(tmp_path) -> None:
    group = start_group([spec(0, "import sys; sys.exit(3)", tmp_path),
                         spec(1, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path),
                         spec(2, "pass", tmp_path)], Console(io.BytesIO(), io.BytesIO()), "hostA")
    wait_until(lambda: all(code is not None for code in group.poll()), 30, "the workers to end")
    failures = group.failures()
    group.stop(grace=1.0)
    assert [(f.rank, f.how, f.host) for f in failures] == [(0, "exit code 3", "hostA"), (1, "signal SIGKILL", "hostA")]
    assert all(f.error is None for f in failures)


def test_failure_summary_shows_the_first_failure_and_its_traceback(tmp_path) -> None:
    error_file = tmp_path / "e.json"
    error_file.write_text('{"type": "ValueError", "message": "boom", "timestamp": 5.0, '
                          '"traceback": "Traceback (most recent call last):\\nValueError: boom\\n"}')
    assert read_error_file(str(error_file)).message == "boom"
    assert read_error_file(str(tmp_path / "missing.json")) is None
    raised = WorkerFailure.from_exit(3, 1, "hostB", 42, 1, str(error_file))
    killed = WorkerFailure.from_exit(2, 0, "hostB", 41, -signal.SIGTERM, None, seen_at=9.0)
    summary = format_summary([killed, raised], "test")
    assert "first failure at" in summary and "rank 3 (local rank 1) on host hostB, pid 42" in summary
    assert "    ValueError: boom" in summary and "also failed: rank 2" in summary and "signal SIGTERM" in summary
    assert WorkerFailure.from_json(raised.to_json()) == raised
    assert describe_exit(-99) == "signal 99" and describe_exit(0) == "exit code 0"
    alone = format_summary([killed], "test")
    assert "no Python traceback" in alone


def test_prefix_goes_at_every_line_start_however_the_output_is_cut() -> None:
    prefixer = _Prefixer(b"[r]: ")
    pieces = [b"a", b"b\nc", b"\n\n", b"10%\r", b"20%\r", b"\n", b"x\r\ny", b""]
    assert b"".join(prefixer(piece) for piece in pieces) + prefixer.end() == (
        b"[r]: ab\n[r]: c\n[r]: \n[r]: 10%\r[r]: 20%\r\n[r]: x\r\n[r]: y\n")


def test_a_progress_update_ending_in_cr_shows_while_the_worker_runs(tmp_path) -> None:
    # The worker writes "10%\r" and then waits on a FIFO that the test opens only after seeing the update.
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    code = ("import sys\n"
            "sys.stdout.write('10%\\r'); sys.stdout.flush()\n"
            f"open({str(fifo)!r}).read()\n"
            "print('100%')\n")
    out = io.BytesIO()
    group = start_group([spec(0, code, tmp_path)], Console(out, io.BytesIO()), "h")
    try:
        wait_until(lambda: out.getvalue() == b"[rank0]: 10%\r", 30, "the progress update")
        with open(fifo, "w"):
            pass
        wait_until(lambda: group.poll() == [0], 30, "the worker to finish")
    finally:
        group.stop(grace=1.0)
    assert out.getvalue() == b"[rank0]: 10%\r[rank0]: 100%\n"
