"""Work: the handle of an asynchronous operation, and its state machine.

Layer: comm. A Work is PENDING until the executor completes or fails it; `wait` re-raises the failure on
the caller's thread. `get_future()` bridges to torch.futures for code written against torch's Work. For an
op on an accelerator, `wait` also orders the waiter's current stream after the op (see ProcessGroup's
Note on streams); on CPU there is no stream and nothing more to do.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from spmd._core.errors import CommTimeoutError
from spmd.comm.debug import OpRecord, OpState


def caller_stream(device: torch.device | None) -> torch.Stream | None:
    """The calling thread's current stream on `device` when it is the accelerator's (CUDA, ...); None for CPU
    tensors (one comparison, so CPU ops pay nothing) and for devices without streams (meta)."""
    if device is None or device.type == "cpu":
        return None
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != device.type:
        return None
    return torch.accelerator.current_stream(device)


def current_stream(device: torch.device) -> torch.Stream:
    """The calling thread's current stream on `device` (the stream a waiter's later kernels go on)."""
    return torch.accelerator.current_stream(device)


class ExposedCommunication:
    """The seconds the calling thread spends blocked on communication inside `with ExposedCommunication() as c:`:
    waiting in Work.wait for an op still in flight, or running a synchronous collective in its own thread. It is
    the communication that overlapping with computation did not hide; a trainer subtracts it from a step's time
    to get the compute. Per thread (a thread rank counts its own); nested timers each count."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._outer: ExposedCommunication | None = None

    def __enter__(self) -> ExposedCommunication:
        self._outer = getattr(_timing, "timer", None)
        _timing.timer = self
        return self

    def __exit__(self, *exc: object) -> None:
        _timing.timer = self._outer


_timing = threading.local()


def active_timer() -> ExposedCommunication | None:
    """The calling thread's innermost ExposedCommunication, or None (one attribute read when none is)."""
    return getattr(_timing, "timer", None)


def charge_exposed(timer: ExposedCommunication, since: float) -> None:
    """Add the time since `since` (time.perf_counter) to `timer` and the timers around it."""
    seconds = time.perf_counter() - since
    while timer is not None:
        timer.seconds += seconds
        timer = timer._outer


class WorkState(enum.Enum):
    PENDING = enum.auto()     # enqueued or running; its output tensors must not be read yet
    COMPLETED = enum.auto()   # finished; outputs hold the result
    FAILED = enum.auto()      # finished with an error; `wait` raises it


class Work:
    """An operation in flight. `wait()` blocks until it finishes and re-raises its error, if any."""

    __slots__ = ("_error", "_finished", "_future", "_lock", "_ready", "description", "outputs", "poll", "record",
                 "source", "state")

    def __init__(self, description: str, outputs: list[Tensor] | None = None,
                 record: OpRecord | None = None) -> None:
        self.description = description
        self.record = record                # the flight-recorder entry this Work finishes
        self.outputs = outputs if outputs is not None else []
        self.state = WorkState.PENDING
        self._error: BaseException | None = None
        self._finished: threading.Event | None = None   # made by the first waiter that finds the op pending
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()
        self.poll: Callable[[], None] | None = None   # set by a transport that can advance the op from `wait`
        self._ready: torch.Event | None = None        # recorded on the op's stream after its device work
        self.source: int | None = None                # a receive's: the group rank it receives from

    def to_completed(self, ready: torch.Event | None = None) -> None:
        """PENDING -> COMPLETED. `ready`: the event after the op's device work, which waiters' streams wait on."""
        with self._lock:
            if self.state is not WorkState.PENDING:
                return
            if self.record is not None:     # before the state: a waiter may read the record at once
                self.record.finish(OpState.COMPLETED)
            self._ready = ready
            self.state = WorkState.COMPLETED
            future, finished = self._future, self._finished
        if finished is not None:
            finished.set()
        if future is not None:
            future.set_result(self.outputs)

    def to_failed(self, error: BaseException) -> None:
        with self._lock:
            if self.state is not WorkState.PENDING:
                return
            if self.record is not None:
                self.record.finish(OpState.FAILED)
            self._error = error
            self.state = WorkState.FAILED
            future, finished = self._future, self._finished
        if finished is not None:
            finished.set()
        if future is not None:
            future.set_exception(error)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation finishes; re-raise its error. `timeout` (s) bounds only this wait.

        A transport that set `poll` gets the waiting thread first, to move the data itself for a while
        (a hand-off to its progress thread and back costs two thread wake-ups). For an op on an accelerator,
        the waiter's current stream then waits for the op's device work (a stream wait, not a host sync).
        """
        timer = active_timer() if self.state is WorkState.PENDING else None
        if timer is not None:
            started = time.perf_counter()
        poll = self.poll
        if poll is not None and self.state is WorkState.PENDING:
            poll()
        if self.state is WorkState.PENDING:
            with self._lock:
                if self.state is WorkState.PENDING and self._finished is None:
                    self._finished = threading.Event()
                finished = self._finished if self.state is WorkState.PENDING else None
            if finished is not None and not finished.wait(timeout):
                raise CommTimeoutError(f"{self.description}: Work.wait timed out after {timeout}s (still running)")
        if timer is not None:
            charge_exposed(timer, started)
        if self._error is not None:
            raise self._error
        if self._ready is not None:
            current_stream(self._ready.device).wait_event(self._ready)
        return True

    def is_completed(self) -> bool:
        return self.state is not WorkState.PENDING

    def is_success(self) -> bool:
        return self.state is WorkState.COMPLETED

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[Tensor]:
        self.wait()
        return self.outputs

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        """torch's: the group rank a receive's message comes from (spmd's receives name their source)."""
        if self.source is None:
            raise ValueError(f"{self.description}: source_rank() is a receive's; this Work is not one")
        return self.source

    def block_current_stream(self) -> None:
        """torch's: the caller's current stream waits for the op. torch's returns at once; spmd's own transports
        run an op on the host, so the host waits for it first, as `wait` does (on the CPU, the same as `wait`)."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A torch Future whose value is the list of output tensors (set when the operation finishes)."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self.state is WorkState.COMPLETED:
                    self._future.set_result(self.outputs)
                elif self.state is WorkState.FAILED:
                    self._future.set_exception(self._error)
            return self._future

    def __repr__(self) -> str:
        return f"Work({self.description}, {self.state.name})"
