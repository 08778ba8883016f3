"""Worker processes: start a local group, pump their output with rank prefixes, and stop whole process trees.

Layer: run. Each worker runs in its own session (so its own process group): stopping it signals the group, which
reaches the helpers it started too. Stopping is SIGTERM (or the signal the launcher itself got), then SIGKILL
after a grace period. A Watchdog process kills the groups if the agent itself dies (see its docstring).

Note: output
Each pipe is read in chunks of at most CHUNK bytes and written prefixed with the rank (`[rank3]: ...`) at every
line start; per-rank log files get the raw bytes. Whole lines are written at once, so lines of different workers
never interleave mid-line, with three exceptions that keep memory bounded and output live (in each, a line that
another writer interrupts is ended there and its rest gets its prefix again): a partial line longer
than CHUNK is forwarded in CHUNK pieces; a partial line followed by IDLE_FLUSH_S of silence (a prompt) is
forwarded as it is; and a carriage return forwards what is buffered up to it, so `\r`-updated progress bars
(tqdm) show each update. The text after a `\r` gets the prefix again: the terminal overwrites the line from its
start, so the rank tag stays visible. On stop, every pump drains its pipe to the end before the agent goes on
(it blocks on a slow console reader, as `cat` would), unless the console is gone (EPIPE).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from spmd.run.failure import WorkerFailure

CHUNK = 64 * 1024  # the most a pump reads or holds of a worker's output at once
IDLE_FLUSH_S = 0.1  # a partial line followed by this much silence is forwarded without waiting for its end
DRAIN_SILENCE_S = 1.0  # once the workers are dead, a pipe silent this long is held open by a process that escaped
_LINE_ENDS = re.compile(rb"(\r\n|\r|\n)")
WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")
WATCHDOG_MARK = "SPMD_WATCHDOG_MARK"   # in every worker's environment: the watchdog finds their descendants by it


class Console:
    """The agent's stdout/stderr, shared by every pump and the agent's own messages; each write goes whole."""

    def __init__(self, out: BinaryIO | None = None, err: BinaryIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self._locks = {id(self.out): threading.Lock(), id(self.err): threading.Lock()}  # a stalled stdout
        self._gone: set[int] = set()  # reader can't hold up stderr; streams whose reader went away (EPIPE)
        self._open_line: dict[int, bytes | None] = {}      # per stream: the writer whose line is left open
        self._cut: dict[int, set[bytes | None]] = {}       # per stream: writers whose open line another closed

    def write(self, stream: BinaryIO, data: bytes, writer: bytes | None = None) -> None:
        """Write and flush `data`; blocks while the reader is slow, drops it once the reader is gone.

        `writer` is a worker's rank prefix (None: the agent). A line another writer left open (a prompt, written
        without its end) is ended first, so lines never run together; the rest of it, when it comes, gets its
        writer's prefix again."""
        key = id(stream)
        with self._locks.setdefault(key, threading.Lock()):
            if key in self._gone:
                return
            cut = self._cut.setdefault(key, set())
            open_by = self._open_line.get(key)
            head = b""
            if open_by is not None and open_by != writer:
                cut.add(open_by)
                head = b"\n"
            if writer is not None and writer in cut:
                cut.discard(writer)
                if data.startswith(b"\n"):
                    data = data[1:]          # the end of the line that was ended for it
                elif data:
                    head += writer
            data = head + data
            if not data:
                return
            self._open_line[key] = writer if data[-1:] not in (b"\n", b"\r") else None
            try:
                stream.write(data)
                stream.flush()
            except (BrokenPipeError, ValueError):  # the console went away (closed pipe); keep the workers running
                self._gone.add(id(stream))
                _discard_further_output(stream)

    def message(self, text: str) -> None:
        """An agent message on stderr, one line per line of `text`."""
        self.write(self.err, "".join(f"{line}\n" for line in text.splitlines()).encode())


def _discard_further_output(stream: BinaryIO) -> None:
    """Point a broken console's file descriptor at /dev/null, so Python's flush at exit does not fail again."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a file (a test's BytesIO) or already closed
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


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


class _Prefixer:
    """Puts the rank prefix at every line start of a byte stream cut at arbitrary points (see Note: output)."""

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.at_line_start = True
        self._after_cr = False  # the last byte was a bare \r: a \n right after it ends that line, it starts none

    def __call__(self, data: bytes) -> bytes:
        out = bytearray()
        for i, piece in enumerate(_LINE_ENDS.split(data)):
            if not piece:
                continue
            if i % 2 == 0:  # text
                if self.at_line_start:
                    out += self.prefix
                out += piece
                self.at_line_start, self._after_cr = False, False
                continue
            if self.at_line_start and piece != b"\r" and not (self._after_cr and piece == b"\n"):
                out += self.prefix  # an empty line shows its rank too
            out += piece
            self.at_line_start, self._after_cr = True, piece == b"\r"
        return bytes(out)

    def end(self) -> bytes:
        """What ends the output: a newline if it stopped mid-line, so the next writer starts a line of its own."""
        return b"" if self.at_line_start else b"\n"


class _Pump(threading.Thread):
    """Copies one pipe of one worker to the console (prefixed) and/or a log file (raw), CHUNK bytes at most at a
    time, until the pipe ends or, once `drain()` was called, stays silent DRAIN_SILENCE_S."""

    def __init__(self, pipe: BinaryIO, prefix: bytes, console: Console, stream: BinaryIO | None,
                 log_path: str | None) -> None:
        super().__init__(name=f"spmdrun-pump-{prefix.decode().strip()}", daemon=True)
        self.pipe, self.console, self.stream, self.log_path = pipe, console, stream, log_path
        self._prefixer = _Prefixer(prefix)
        self._pending = bytearray()  # the start of a line not forwarded yet (at most 2 * CHUNK bytes)
        self._drain_from: float | None = None  # when drain() was called

    def drain(self) -> None:
        """The workers are dead: stop once the pipe ends or nothing more comes for DRAIN_SILENCE_S."""
        self._drain_from = time.monotonic()

    def run(self) -> None:
        log = open(self.log_path, "wb") if self.log_path else None  # one file per rank and round
        poller = select.poll()
        poller.register(self.pipe.fileno(), select.POLLIN)
        silent_since = time.monotonic()
        try:
            while True:
                wait = IDLE_FLUSH_S if self._pending else DRAIN_SILENCE_S / 4
                if poller.poll(wait * 1000):
                    data = os.read(self.pipe.fileno(), CHUNK)
                    if not data:
                        break
                    silent_since = time.monotonic()
                    if log is not None:
                        log.write(data)
                        log.flush()
                    self._take(data)
                elif self._pending:
                    self._forward(len(self._pending))
                elif self._drain_from is not None and (
                        time.monotonic() - max(silent_since, self._drain_from) >= DRAIN_SILENCE_S):
                    break
            self._forward(len(self._pending))
            self._show(self._prefixer.end())
        finally:
            self.pipe.close()
            if log is not None:
                log.close()

    def _take(self, data: bytes) -> None:
        """Forward every whole line (or \r-ended update) of what is pending; keep the rest unless it is too long."""
        pending = self._pending
        pending += data
        end = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if end:
            self._forward(end)
        if len(pending) >= CHUNK:
            self._forward(len(pending))

    def _forward(self, size: int) -> None:
        data = bytes(self._pending[:size])
        del self._pending[:size]
        self._show(self._prefixer(data))

    def _show(self, data: bytes) -> None:
        if self.stream is not None and data:
            self.console.write(self.stream, data, self._prefixer.prefix)


class Watchdog:
    """A process that SIGKILLs the workers' process groups, then sweeps their /dev/shm names, when the agent dies.

    Workers die with the agent through their parent-death signal, but what they started would live on. The
    watchdog (spmd/run/watchdog.py, started once per agent, before any worker, in a session of its own and without
    a parent-death signal) reads a pipe whose write end only the agent holds: `+PGID` and `-PGID` lines track the
    running groups, and end of file, which comes however the agent ends, even by SIGKILL, makes it kill every group
    still tracked. A subreaper would not do: it adopts orphans, but dies with the agent. Workers carry `mark` in
    their environment as SPMD_WATCHDOG_MARK, and so does what they start: the watchdog also kills every process
    that has it, which finds those that left their group (setsid, a daemon's double fork).
    """

    def __init__(self, python: str = sys.executable) -> None:
        self.mark = secrets.token_hex(8)
        read_end, self._pipe = os.pipe()
        try:
            self.popen = subprocess.Popen([python, WATCHDOG, str(read_end), f"{WATCHDOG_MARK}={self.mark}"],
                                          pass_fds=(read_end,),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(self._pipe)
            raise
        finally:
            os.close(read_end)
        self._lock = threading.Lock()

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._pipe >= 0:
                os.write(self._pipe, line.encode())

    def close(self) -> None:
        """The agent is done with its workers: the watchdog kills what is left, sweeps, and exits."""
        with self._lock:
            if self._pipe >= 0:
                os.close(self._pipe)
                self._pipe = -1
        self.popen.wait()


class Worker:
    """One running worker process and its output pumps."""

    def __init__(self, spec: WorkerSpec, console: Console, watchdog: Watchdog | None = None) -> None:
        self.spec = spec
        for path in (spec.stdout_log, spec.stderr_log, spec.error_file):
            if path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(spec.error_file):
            os.remove(spec.error_file)
        env = spec.env if watchdog is None else {**spec.env, WATCHDOG_MARK: watchdog.mark}
        # stdin is spmdrun's, as under torchrun: spmd.breakpoint's pdb reads the terminal through it
        self.popen = subprocess.Popen(list(spec.argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True)
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.watch(self.popen.pid)  # its session id is its pid, and so is its process group's id
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

    def drain_output(self) -> None:
        """Tell the pumps the process group is dead: they end once its pipes are read to the end."""
        for pump in self.pumps:
            pump.drain()


class WorkerGroup:
    """The workers of one node for one rendezvous round."""

    def __init__(self, console: Console, host: str, watchdog: Watchdog | None = None) -> None:
        self.console = console
        self.host = host
        self.watchdog = watchdog
        self.workers: list[Worker] = []

    def start(self, specs: list[WorkerSpec]) -> None:
        """Start the workers; each is tracked as soon as it exists, so an interrupted start still stops them all."""
        for spec in specs:
            self.workers.append(Worker(spec, self.console, self.watchdog))

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
            worker.signal_tree(signal.SIGKILL)  # the whole group: helpers that outlived their worker too
            worker.popen.wait()
            worker.poll()
        for worker in self.workers:
            worker.drain_output()
        for worker in self.workers:
            for pump in worker.pumps:
                pump.join()  # as long as the console's reader takes: the workers' last lines are not dropped
            if self.watchdog is not None:
                self.watchdog.forget(worker.pid)
