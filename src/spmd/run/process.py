"""Worker processes: start a local group, pump their output a line at a time, and stop whole process trees.

Layer: run. Each worker runs in its own session (so its own process group): stopping it signals the group, which
reaches the helpers it started too. Stopping is SIGTERM (or the signal the launcher itself got), then SIGKILL
after a grace period. Output is read line by line from pipes and written whole, prefixed with the rank
(`[rank3]: ...`), so lines of different workers never interleave mid-line; per-rank log files get the raw lines.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from spmd.run.failure import WorkerFailure


class Console:
    """The agent's stdout/stderr, shared by every pump and the agent's own messages; writes whole lines."""

    def __init__(self, out: BinaryIO | None = None, err: BinaryIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self._lock = threading.Lock()

    def write(self, stream: BinaryIO, data: bytes) -> None:
        with self._lock:
            try:
                stream.write(data)
                stream.flush()
            except (BrokenPipeError, ValueError):  # the console went away (closed pipe); keep the workers running
                pass

    def message(self, text: str) -> None:
        """An agent message on stderr, one line per line of `text`."""
        self.write(self.err, "".join(f"{line}\n" for line in text.splitlines()).encode())


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker and where its output goes."""

    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    error_file: str
    stdout_log: str | None = None  # raw copy of stdout (None: no file)
    stderr_log: str | None = None
    stdout_to_console: bool = True
    stderr_to_console: bool = True


class _Pump(threading.Thread):
    """Copies one pipe of one worker to the console (prefixed) and/or a log file (raw), a whole line at a time."""

    def __init__(self, pipe: BinaryIO, prefix: bytes, console: Console, stream: BinaryIO | None,
                 log_path: str | None) -> None:
        super().__init__(name=f"spmdrun-pump-{prefix.decode().strip()}", daemon=True)
        self.pipe, self.prefix, self.console, self.stream, self.log_path = pipe, prefix, console, stream, log_path

    def run(self) -> None:
        log = open(self.log_path, "wb") if self.log_path else None  # one file per rank and round
        try:
            for line in iter(self.pipe.readline, b""):
                if not line.endswith(b"\n"):  # the last line of a worker that exited mid-line
                    line += b"\n"
                if log is not None:
                    log.write(line)
                    log.flush()
                if self.stream is not None:
                    self.console.write(self.stream, self.prefix + line)
        finally:
            self.pipe.close()
            if log is not None:
                log.close()


class Worker:
    """One running worker process and its output pumps."""

    def __init__(self, spec: WorkerSpec, console: Console) -> None:
        self.spec = spec
        for path in (spec.stdout_log, spec.stderr_log, spec.error_file):
            if path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(spec.error_file):
            os.remove(spec.error_file)
        self.popen = subprocess.Popen(list(spec.argv), env=spec.env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.exit_seen_at: float | None = None
        prefix = f"[rank{spec.rank}]: ".encode()
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self.pumps = [
            _Pump(self.popen.stdout, prefix, console, console.out if spec.stdout_to_console else None, spec.stdout_log),
            _Pump(self.popen.stderr, prefix, console, console.err if spec.stderr_to_console else None, spec.stderr_log),
        ]
        for pump in self.pumps:
            pump.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.exit_seen_at is None:
            self.exit_seen_at = time.time()
        return code

    def signal_tree(self, signum: int) -> None:
        """Send `signum` to the worker's whole process group (it leads its own session)."""
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):  # the group is already gone
            pass

    def join_output(self, timeout: float) -> None:
        """Wait for the pumps to drain (a grandchild that kept the pipe open can't hold us beyond `timeout`)."""
        deadline = time.monotonic() + timeout
        for pump in self.pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


class WorkerGroup:
    """The workers of one node for one rendezvous round."""

    def __init__(self, console: Console, host: str) -> None:
        self.console = console
        self.host = host
        self.workers: list[Worker] = []

    def start(self, specs: list[WorkerSpec]) -> None:
        """Start the workers; each is tracked as soon as it exists, so an interrupted start still stops them all."""
        for spec in specs:
            self.workers.append(Worker(spec, self.console))

    def poll(self) -> list[int | None]:
        """Each worker's exit code (None while it runs), in local rank order."""
        return [worker.poll() for worker in self.workers]

    def failures(self) -> list[WorkerFailure]:
        """Workers that ended badly on their own (call before `stop`, which makes the others end by signal)."""
        found = []
        for worker in self.workers:
            code = worker.poll()
            if code is not None and code != 0:
                found.append(WorkerFailure.from_exit(worker.spec.rank, worker.spec.local_rank, self.host, worker.pid,
                                                     code, worker.spec.error_file, worker.exit_seen_at))
        return found

    def stop(self, signum: int = signal.SIGTERM, grace: float = 5.0) -> None:
        """Stop every worker's process tree: `signum`, then SIGKILL after `grace` seconds; reap them all.

        Idempotent, and safe to call again if a signal interrupted an earlier call.
        """
        for worker in self.workers:
            worker.signal_tree(signum)  # also to exited leaders: their children may live on in the group
        deadline = time.monotonic() + grace
        for worker in self.workers:
            try:
                worker.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for worker in self.workers:
            worker.signal_tree(signal.SIGKILL)
            worker.popen.wait()
            worker.poll()
        for worker in self.workers:
            worker.join_output(timeout=2.0)
