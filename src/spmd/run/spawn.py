"""spawn(fn, args, nprocs): start N processes running `fn(i, *args)` from Python, like torch.multiprocessing.spawn.

Layer: run. Each child gets the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, SPMD_STORE_TOKEN), so `spmd.init_process_group()` with no arguments works inside `fn`;
values the parent already has in its environment (MASTER_ADDR, MASTER_PORT) are kept. A child that raises records
its traceback the way spmdrun's workers do; `join` stops the others and raises ProcessRaisedException (or
ProcessExitedException for a child that died without raising) with the same summary spmdrun prints.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from spmd.run.bootstrap import format_user_traceback, set_parent_death_signal, write_error_file
from spmd.run.failure import ProcessExitedException, ProcessRaisedException, WorkerFailure

_STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when stopping the other children after a failure


def _child(fn: Callable[..., Any], index: int, args: tuple[Any, ...], env: dict[str, str], error_file: str,
           parent_pid: int) -> None:
    """The child process's entry: environment, parent-death signal, then `fn(index, *args)`."""
    os.environ.update(env)
    set_parent_death_signal(parent_pid)
    try:
        fn(index, *args)
    except KeyboardInterrupt:
        pass  # the parent is stopping the job (Ctrl-C reaches the whole process group)
    except SystemExit:
        raise
    except BaseException as error:  # recorded for the parent, then reported as Python would
        formatted = format_user_traceback(error, skip={os.path.abspath(__file__)})
        write_error_file(error_file, error, formatted, index)
        sys.stderr.write(formatted)
        sys.stderr.flush()
        sys.exit(1)


class SpawnContext:
    """The children of one `spawn` call; `join()` waits for them (torch.multiprocessing's ProcessContext)."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess], error_dir: str) -> None:
        self.processes = processes
        self.error_dir = error_dir
        self._host = socket.gethostname()

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes if process.pid is not None]

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: until the end). True when every child exited 0; False if some still
        run. On the first failure the other children are stopped and ProcessRaisedException (the child raised)
        or ProcessExitedException (it exited non-zero or by a signal without raising) is raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            running = [process for process in self.processes if process.exitcode is None]
            failed = [(i, process) for i, process in enumerate(self.processes) if process.exitcode not in (None, 0)]
            if failed:
                self._fail(failed)
            if not running:
                shutil.rmtree(self.error_dir, ignore_errors=True)
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            multiprocessing.connection.wait([process.sentinel for process in running], timeout=remaining)

    def _fail(self, failed: list[tuple[int, multiprocessing.process.BaseProcess]]) -> None:
        failures = [self._failure(i, process) for i, process in failed]
        self.terminate()
        shutil.rmtree(self.error_dir, ignore_errors=True)
        error_type = ProcessRaisedException if any(f.error is not None for f in failures) else ProcessExitedException
        raise error_type(failures, f"spawn of {len(self.processes)} processes")

    def _failure(self, index: int, process: multiprocessing.process.BaseProcess) -> WorkerFailure:
        assert process.exitcode is not None and process.pid is not None
        return WorkerFailure.from_exit(index, index, self._host, process.pid, process.exitcode,
                                       os.path.join(self.error_dir, f"{index}.json"))

    def terminate(self) -> None:
        """Stop every child still running: SIGTERM, then SIGKILL after a grace period."""
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()
        deadline = time.monotonic() + _STOP_GRACE
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
                process.join()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn") -> SpawnContext | None:
    """Run `fn(i, *args)` in `nprocs` new processes, i = 0..nprocs-1; with `join`, wait and return None.

    `fn` must be picklable (a module-level function) since children start fresh with the "spawn" method.
    Children die with this process (a parent-death signal, armed by the thread that calls spawn). With
    `join=False` the SpawnContext is returned for the caller to `join()`.

    >>> import spmd.run
    >>> spmd.run.spawn(print, args=("hello",), nprocs=0)
    Traceback (most recent call last):
    ValueError: spmd.run.spawn: nprocs must be at least 1, got 0
    """
    if nprocs < 1:
        raise ValueError(f"spmd.run.spawn: nprocs must be at least 1, got {nprocs}")
    ctx = multiprocessing.get_context(start_method)
    error_dir = tempfile.mkdtemp(prefix="spmd-spawn-")
    shared = {
        "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
        "SPMD_STORE_TOKEN": secrets.token_hex(16),
    }
    processes = []
    for index in range(nprocs):
        env = {**shared, "RANK": str(index), "LOCAL_RANK": str(index)}
        process = ctx.Process(target=_child, daemon=daemon, name=f"spmd-spawn-{index}",
                              args=(fn, index, args, env, os.path.join(error_dir, f"{index}.json"), os.getpid()))
        process.start()
        processes.append(process)
    context = SpawnContext(processes, error_dir)
    if not join:
        return context
    try:
        context.join()
    except BaseException:
        context.terminate()
        raise
    return None
