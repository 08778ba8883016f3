"""Worker failures as the launcher reports them: what failed, where, how, and the worker's own traceback.

Layer: run. The worker side (spmd.run.bootstrap) writes an error file when the user's code raises; here the agent
turns an exit status plus that file into a WorkerFailure, ships it between nodes as JSON, and formats the
summary a person reads: the root cause (its rank, host, exit code or signal name and traceback), then the failures
that followed from it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import time
from typing import Any

from spmd._core.errors import SpmdError


def describe_exit(exit_code: int) -> str:
    """'exit code 3' or 'signal SIGKILL' (a negative code from subprocess means killed by that signal)."""
    if exit_code < 0:
        try:
            return f"signal {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"signal {-exit_code}"
    return f"exit code {exit_code}"


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """The exception a worker's Python code raised, as its bootstrap recorded it."""

    type: str
    message: str
    traceback: str
    timestamp: float


def read_error_file(path: str) -> WorkerError | None:
    """The error a worker recorded at `path`, or None if it wrote none (it exited or was killed without raising)."""
    try:
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return WorkerError(type=str(record.get("type", "")), message=str(record.get("message", "")),
                       traceback=str(record.get("traceback", "")), timestamp=float(record.get("timestamp", 0.0)))


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """One worker that exited non-zero or by a signal (not one the launcher itself stopped)."""

    rank: int  # global rank
    local_rank: int
    host: str
    pid: int
    exit_code: int  # negative: killed by signal -exit_code
    timestamp: float  # when it failed: the error file's time, else when the agent saw the exit
    error: WorkerError | None = None

    @staticmethod
    def from_exit(rank: int, local_rank: int, host: str, pid: int, exit_code: int, error_file: str | None,
                  seen_at: float | None = None) -> WorkerFailure:
        error = read_error_file(error_file) if error_file and os.path.exists(error_file) else None
        when = error.timestamp if error is not None else (seen_at if seen_at is not None else time.time())
        return WorkerFailure(rank, local_rank, host, pid, exit_code, when, error)

    @property
    def how(self) -> str:
        return describe_exit(self.exit_code)

    def headline(self) -> str:
        what = f"raised {self.error.type}: {self.error.message}" if self.error else "failed"
        return (f"rank {self.rank} (local rank {self.local_rank}) on host {self.host}, pid {self.pid}, {what}; "
                f"{self.how}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> WorkerFailure:
        error = data.get("error")
        return WorkerFailure(**{**data, "error": WorkerError(**error) if error else None})


# Errors that report another rank's failure or absence (a lost peer, an abort, a peer that never came) rather
# than a failure of their own: a root cause is looked for among the other failures first.
CONSEQUENCES = frozenset({"PeerLostError", "GroupAbortedError", "CommTimeoutError"})
_BLAMED = re.compile(r"(?<!group )\brank (\d+)\b")


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    """The failure the others are consequences of: the earliest that is not a consequence type (an exception of
    its own, a crash, a kill); else, when every failure reports another rank, the failed rank they name most;
    else the earliest."""
    by_time = sorted(failures, key=lambda failure: (failure.timestamp, failure.rank))
    own = [failure for failure in by_time if failure.error is None or failure.error.type not in CONSEQUENCES]
    if own:
        return own[0]
    failed = {failure.rank: failure for failure in by_time}
    blamed = collections.Counter(rank for failure in by_time if failure.error is not None
                                 for rank in {int(r) for r in _BLAMED.findall(failure.error.message)} - {failure.rank})
    for rank, _ in blamed.most_common():
        if rank in failed:
            return failed[rank]
    return by_time[0]


def format_summary(failures: list[WorkerFailure], context: str, lost: str | None = None) -> str:
    """The report printed when a job fails: the root cause in full, then the other failures, one line each.

    `lost` describes nodes lost from the job (their agents died): then that is the root cause, and every worker
    failure is a consequence."""
    lines = [f"spmdrun: job failed ({context})"]
    if lost is not None:
        first = None
        lines.append(f"  root cause: {lost}")
    else:
        first = root_cause(failures)
        when = time.strftime("%H:%M:%S", time.localtime(first.timestamp))
        lines.append(f"  root cause at {when}: {first.headline()}")
        if first.error is not None:
            lines.append("  its traceback:")
            lines.extend("    " + line for line in first.error.traceback.rstrip("\n").splitlines())
        else:
            lines.append(f"  no Python traceback: the worker ended by {first.how} without raising (a crash in "
                         "native code, os._exit, sys.exit or a kill from outside)")
    others = sorted((failure for failure in failures if failure is not first), key=lambda failure: failure.rank)
    if others:
        lines.append("  other failures (likely its consequences):")
        lines.extend(f"    {other.headline()}" for other in others)
    return "\n".join(lines)


class ChildFailedError(SpmdError):
    """Worker processes failed; `failures` holds each one and `first` the root cause."""

    def __init__(self, failures: list[WorkerFailure], context: str) -> None:
        self.failures = failures
        self.first = root_cause(failures)
        super().__init__(format_summary(failures, context))


class ProcessException(ChildFailedError):
    """A spawned process failed (torch.multiprocessing's name); `error_index` is its process index."""

    @property
    def error_index(self) -> int:
        return self.first.rank

    @property
    def pid(self) -> int:
        return self.first.pid


class ProcessRaisedException(ProcessException):
    """A spawned process raised."""


class ProcessExitedException(ProcessException):
    """A spawned process exited non-zero or by a signal without raising."""

    @property
    def exit_code(self) -> int:
        return self.first.exit_code

    @property
    def signal_name(self) -> str | None:
        return self.first.how.removeprefix("signal ") if self.first.exit_code < 0 else None
