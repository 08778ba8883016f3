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

from spmd.run.failure import WorkerError, WorkerFailure, describe_exit, format_summary, read_error_file, root_cause
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


def test_a_line_left_open_is_ended_when_another_writer_writes_and_its_rest_is_prefixed_again() -> None:
    # a pdb prompt ("(Pdb) ", no newline) of rank 1 while rank 0 prints: the lines must not run together
    out = io.BytesIO()
    console = Console(out, io.BytesIO())
    console.write(out, b"[rank1]: (Pdb) ", b"[rank1]: ")
    console.write(out, b"[rank0]: after 0\n", b"[rank0]: ")
    console.write(out, b"after 1\n", b"[rank1]: ")
    console.write(out, b"[rank2]: no end", b"[rank2]: ")
    console.write(out, b"[rank0]: y\n", b"[rank0]: ")
    console.write(out, b"\n", b"[rank2]: ")          # the end of a line that was already ended: nothing more
    assert out.getvalue() == b"[rank1]: (Pdb) \n[rank0]: after 0\n[rank1]: after 1\n[rank2]: no end\n[rank0]: y\n"


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


def test_failure_summary_shows_the_root_cause_and_its_traceback(tmp_path) -> None:
    error_file = tmp_path / "e.json"
    error_file.write_text('{"type": "ValueError", "message": "boom", "timestamp": 5.0, '
                          '"traceback": "Traceback (most recent call last):\\nValueError: boom\\n"}')
    assert read_error_file(str(error_file)).message == "boom"
    assert read_error_file(str(tmp_path / "missing.json")) is None
    raised = WorkerFailure.from_exit(3, 1, "hostB", 42, 1, str(error_file))
    killed = WorkerFailure.from_exit(2, 0, "hostB", 41, -signal.SIGTERM, None, seen_at=9.0)
    summary = format_summary([killed, raised], "test")
    assert "root cause at" in summary and "rank 3 (local rank 1) on host hostB, pid 42" in summary
    assert "    ValueError: boom" in summary and "signal SIGTERM" in summary
    assert "other failures (likely its consequences):\n    rank 2 (local rank 0) on host hostB" in summary
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


def _raised(rank: int, host: str, when: float, error_type: str, message: str) -> WorkerFailure:
    return WorkerFailure(rank, rank % 2, host, 100 + rank, 1, when, WorkerError(error_type, message, "tb", when))


def test_the_root_cause_is_a_failure_of_its_own_not_the_earliest_report_of_a_lost_peer() -> None:
    timeout = _raised(3, "hostB", 1.0, "CommTimeoutError", "rank 0 on hostA did not publish its address")
    unreachable = _raised(2, "hostB", 2.0, "PeerUnreachableError", "rank 2 on hostB can't reach rank 0 on hostA")
    lost = _raised(0, "hostA", 1.5, "PeerLostError", "lost the connection to rank 2 on hostB")
    assert root_cause([timeout, unreachable, lost]) is unreachable
    summary = format_summary([timeout, unreachable, lost], "test")
    assert "root cause at" in summary and "rank 2 (local rank 0) on host hostB" in summary.splitlines()[1]
    assert summary.splitlines()[-2:] == [f"    {lost.headline()}", f"    {timeout.headline()}"]


def test_when_every_failure_reports_another_rank_the_one_they_name_is_the_root_cause() -> None:
    seen = _raised(2, "hostB", 2.0, "PeerLostError", "rank 2 on hostB: rank 3 on hostB (group rank 1, pid 9) died")
    heard = _raised(0, "hostA", 1.0, "PeerLostError", "rank 0 on hostA: rank 3 on hostB (group rank 1, pid 9) died "
                                                      "(seen first by rank 2 on hostB)")
    timed_out = _raised(1, "hostA", 0.5, "CommTimeoutError", "rank 1 on hostA: timed out; rank 2 never entered")
    assert root_cause([seen, heard, timed_out]) is seen      # rank 3 did not fail by itself; rank 2 is named most
    assert root_cause([heard, timed_out]) is timed_out      # nobody named failed: the earliest


def test_a_lost_node_is_the_root_cause_of_every_worker_failure() -> None:
    lost = _raised(0, "hostA", 1.0, "PeerLostError", "lost the connection to rank 2 on hostB")
    summary = format_summary([lost], "run r; lost hostB", lost="lost hostB (node 2, ranks 2-3): no heartbeat")
    assert summary.splitlines() == ["spmdrun: job failed (run r; lost hostB)",
                                    "  root cause: lost hostB (node 2, ranks 2-3): no heartbeat",
                                    "  other failures (likely its consequences):", f"    {lost.headline()}"]
