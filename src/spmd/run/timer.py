"""Expiration timers (torch's `elastic.timer`): a worker declares that a block of its code must end by a deadline,
`with expires(after=60): ...`, and a server beside it kills the worker (SIGKILL by default) if the block has not
ended by then. A rank stuck outside any collective (a data loader, a filesystem, a deadlocked thread) then ends
instead of holding the job; under spmdrun the agent names the rank and the scope, and restarts the job within
its --max-restarts budget.

Layer: run. Two client/server pairs, as torch's:
- FileTimerClient / FileTimerServer talk over a FIFO, one JSON line per request (torch's fields, so either
  library's client talks to either's server), each written whole (under PIPE_BUF bytes). spmdrun starts the
  server when TORCHELASTIC_ENABLE_FILE_TIMER=1 and names its FIFO to the workers in TORCHELASTIC_TIMER_FILE.
- LocalTimerClient / LocalTimerServer talk over a multiprocessing queue (a server the user starts).
A release is a request whose expiration time is negative. A server checks its timers every `max_interval`
seconds, so a worker dies at most that long after its deadline; timers of processes that ended are dropped.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_FILE_FORMAT_VERSION = 1


class TimerRequest:
    """A timer of worker `worker_id` for `scope_id`, expiring at `expiration_time` (time.time(); negative: the
    release of that scope's timer)."""

    __slots__ = ("expiration_time", "scope_id", "worker_id")

    def __init__(self, worker_id: Any, scope_id: str, expiration_time: float) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TimerRequest) and (self.worker_id, self.scope_id, self.expiration_time) ==
                (other.worker_id, other.scope_id, other.expiration_time))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_id!r}, {self.scope_id!r}, {self.expiration_time})"


class TimerClient(abc.ABC):
    """What a worker sends its timer server."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Start this worker's timer for `scope_id`, expiring at `expiration_time` (time.time())."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """End this worker's timer for `scope_id`."""


_client: TimerClient | None = None


def configure(timer_client: TimerClient) -> None:
    """The client `expires` uses when given none (once per worker process)."""
    global _client
    _client = timer_client


@contextlib.contextmanager
def expires(after: float, scope: str | None = None, client: TimerClient | None = None) -> Iterator[None]:
    """Have the timer server kill this worker unless the block ends within `after` seconds. `scope` names the
    block in the server's report (default: the caller's file and line); `client` defaults to configure()'s."""
    client = client if client is not None else _client
    if client is None:
        raise RuntimeError("expires: no timer client; call spmd.elastic.timer.configure(client) first (under spmdrun "
                           "with TORCHELASTIC_ENABLE_FILE_TIMER=1: FileTimerClient(os.environ["
                           "'TORCHELASTIC_TIMER_FILE'])), or pass client=")
    if scope is None:    # the with statement: past this generator's frame and contextlib's __enter__
        frame = sys._getframe(2)
        scope = f"{frame.f_code.co_filename}#{frame.f_lineno}"
    client.acquire(scope, time.time() + after)
    try:
        yield
    finally:
        client.release(scope)


class _Timers:
    """The live timers of a server: by worker, then by scope."""

    def __init__(self) -> None:
        self.by_worker: dict[Any, dict[str, TimerRequest]] = {}

    def register(self, requests: list[TimerRequest]) -> None:
        for request in requests:
            scopes = self.by_worker.setdefault(request.worker_id, {})
            if request.expiration_time < 0:
                scopes.pop(request.scope_id, None)
            else:
                scopes[request.scope_id] = request
            if not scopes:
                del self.by_worker[request.worker_id]

    def expired(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        found = {worker: [r for r in scopes.values() if r.expiration_time <= deadline]
                 for worker, scopes in self.by_worker.items()}
        return {worker: requests for worker, requests in found.items() if requests}

    def clear(self, workers: set[Any]) -> None:
        for worker in workers:
            self.by_worker.pop(worker, None)


class _Rounds:
    """A server's thread: `round()` again and again until stopped."""

    def __init__(self, round: Callable[[], None], name: str, daemon: bool) -> None:
        self._round = round
        self._name = name
        self._daemon = daemon
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=self._daemon)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._round()


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # alive, someone else's
        return True
    return True


# -- over a FIFO ----------------------------------------------------------------------------------------------

class FileTimerRequest(TimerRequest):
    """A request over the FIFO: the worker's pid and the signal to kill it with (0 or less: none)."""

    __slots__ = ("signal", "version")

    def __init__(self, worker_pid: int, scope_id: str, expiration_time: float, signal: int = 0) -> None:
        super().__init__(worker_pid, scope_id, expiration_time)
        self.version = _FILE_FORMAT_VERSION
        self.signal = signal

    @property
    def worker_pid(self) -> int:
        return self.worker_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FileTimerRequest) and super().__eq__(other) and self.signal == other.signal

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "pid": self.worker_pid, "scope_id": self.scope_id,
                           "expiration_time": self.expiration_time, "signal": self.signal})


class FileTimerClient(TimerClient):
    """A worker's client of the FileTimerServer reading the FIFO at `file_path`; `signal` is what the server
    kills this worker with when a timer expires."""

    def __init__(self, file_path: str, signal: int = signal.SIGKILL) -> None:
        self._file_path = file_path
        self.signal = signal

    def _send(self, request: FileTimerRequest) -> None:
        line = (request.to_json() + "\n").encode()
        if len(line) > select.PIPE_BUF:
            raise ValueError(f"FileTimerClient: the request for scope {request.scope_id!r} is {len(line)} bytes, "
                             f"more than a FIFO writes whole ({select.PIPE_BUF}); use a shorter scope name")
        try:
            fd = os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            raise RuntimeError(f"FileTimerClient: no timer server reads {self._file_path} ({error.strerror}); "
                               f"spmdrun starts one with TORCHELASTIC_ENABLE_FILE_TIMER=1") from None
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._send(FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        self._send(FileTimerRequest(os.getpid(), scope_id, -1))


LogEvent = Callable[[str, "FileTimerRequest | None"], None]


class FileTimerServer:
    """Reads the timer requests of this host's workers from a FIFO it creates at `file_path`, and kills each worker
    whose timer expired with the signal its client asked for. `log_event(name, request)` hears each event
    ("timer expired", "process gone"); `run_id` names the job in them."""

    def __init__(self, file_path: str, run_id: str, max_interval: float = 10, daemon: bool = True,
                 log_event: LogEvent | None = None) -> None:
        self._file_path = file_path
        self._run_id = run_id
        self._max_interval = max_interval
        self._log_event = log_event or (lambda name, request: None)
        self._timers = _Timers()
        self._rounds = _Rounds(lambda: self._round(self._max_interval), "spmd-file-timer-server", daemon)
        self._fd: int | None = None
        self._pending = b""
        self._last_progress_time = time.time()
        if os.path.exists(file_path):
            os.remove(file_path)
        os.mkfifo(file_path)

    def start(self) -> None:
        """Start reading and checking on a thread of its own."""
        self._open()
        self._rounds.start()

    def stop(self) -> None:
        """Stop the thread and remove the FIFO."""
        self._rounds.stop()
        self._close()

    def run_once(self) -> None:
        """One round, on the calling thread: read what is waiting, then kill the workers whose timers expired."""
        self._open()
        self._round(0.0)

    def get_last_progress_time(self) -> int:
        """When the server last finished a round (time.time(), whole seconds, as torch's)."""
        return int(self._last_progress_time)

    @staticmethod
    def is_process_running(pid: int) -> bool:
        return _process_running(pid)

    def _open(self) -> None:
        if self._fd is None:     # read and write: the FIFO never reports end of file while clients come and go
            self._fd = os.open(self._file_path, os.O_RDWR | os.O_NONBLOCK)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._file_path)

    def _round(self, wait: float) -> None:
        self._timers.register(self._read(wait))
        now = time.time()
        for pid, requests in self._timers.expired(now).items():
            for request in requests:
                self._log_event("timer expired", request)
            kill_with = max(request.signal for request in requests)
            if kill_with > 0 and _process_running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, kill_with)
            self._timers.clear({pid})
        gone = {pid for pid in self._timers.by_worker if not _process_running(pid)}
        for pid in gone:
            for request in self._timers.by_worker[pid].values():
                self._log_event("process gone", request)
        self._timers.clear(gone)
        self._last_progress_time = now

    def _read(self, wait: float) -> list[FileTimerRequest]:
        """The requests that arrive within `wait` seconds (or are waiting)."""
        assert self._fd is not None
        readable, _, _ = select.select([self._fd], [], [], wait)
        if not readable:
            return []
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return []
        *lines, self._pending = (self._pending + data).split(b"\n")
        requests = []
        for line in lines:
            try:
                fields = json.loads(line)
                requests.append(FileTimerRequest(int(fields["pid"]), str(fields["scope_id"]),
                                                 float(fields["expiration_time"]), int(fields["signal"])))
            except (ValueError, KeyError, TypeError):      # not a client's request: the others still count
                self._log_event(f"unreadable request {line[:200]!r}", None)
        return requests


# -- over a multiprocessing queue --------------------------------------------------------------------------

class RequestQueue(abc.ABC):
    """Where a TimerServer takes its requests from."""

    @abc.abstractmethod
    def size(self) -> int:
        """How many requests are waiting (at least)."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to `size` requests, waiting up to `timeout` seconds for the first."""


class MultiprocessingRequestQueue(RequestQueue):
    """A multiprocessing queue of TimerRequests."""

    def __init__(self, mp_queue: Any) -> None:
        self._queue = mp_queue

    def size(self) -> int:
        return self._queue.qsize()

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        requests: list[TimerRequest] = []
        deadline = time.monotonic() + timeout
        while len(requests) < max(size, 1):
            try:
                requests.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
            deadline = time.monotonic()     # after the first, only what is already there
        return requests


class TimerServer(abc.ABC):
    """A server over a RequestQueue: every `max_interval` seconds at most it registers what arrived and reaps the
    workers whose timers expired. Subclasses keep the timers and say how to reap."""

    def __init__(self, request_queue: RequestQueue, max_interval: float, daemon: bool = True) -> None:
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._rounds = _Rounds(self._run_watchdog, "spmd-timer-server", daemon)

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Add, renew or (negative expiration) release timers."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Forget every timer of these workers."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """The timers expired by `deadline`, by worker."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Any) -> bool:
        """Kill the worker; whether it is gone."""

    def start(self) -> None:
        self._rounds.start()

    def stop(self) -> None:
        self._rounds.stop()

    def _run_watchdog(self) -> None:
        self.register_timers(self._request_queue.get(self._request_queue.size(), self._max_interval))
        reaped = {worker for worker in self.get_expired_timers(time.time()) if self._reap_worker(worker)}
        self.clear_timers(reaped)


class LocalTimerClient(TimerClient):
    """A worker's client of the LocalTimerServer reading `mp_queue`."""

    def __init__(self, mp_queue: Any) -> None:
        self._queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._queue.put(TimerRequest(os.getpid(), scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self._queue.put(TimerRequest(os.getpid(), scope_id, -1))


class LocalTimerServer(TimerServer):
    """Kills (SIGKILL) the workers of this host whose timers, sent over `mp_queue`, expired."""

    def __init__(self, mp_queue: Any, max_interval: float = 60, daemon: bool = True) -> None:
        super().__init__(MultiprocessingRequestQueue(mp_queue), max_interval, daemon)
        self._timers = _Timers()

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        self._timers.register(timer_requests)

    def clear_timers(self, worker_ids: set[Any]) -> None:
        self._timers.clear(worker_ids)

    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        return self._timers.expired(deadline)

    def _reap_worker(self, worker_id: Any) -> bool:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_id, signal.SIGKILL)
        return True
