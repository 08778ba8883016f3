"""A pool of long-lived rank processes for multi-process tests: spawn once (torch imported once), reuse often.

Spawning a process and importing torch costs about 3 s here, so a test that needs real processes borrows
them from a ProcPool instead. `pool.run(fn, world_size, timeout=...)` runs the picklable module-level function
`fn(rank, world_size, *args)` on `world_size` workers at once, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
(and any `env`) set for the call, and returns the per-rank results. Every call has a timeout. When a call fails,
times out, or a worker dies, the workers of that call are killed and replaced before the error is raised, so the
next test starts from clean processes; after a successful call a worker that left a process group initialized
is replaced too. tests/conftest.py provides one pool per session (fixture `procpool`) and shuts it down at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_SPAWN_TIMEOUT = 120.0


class WorkerFailure(RuntimeError):
    """A rank raised in a pool worker; the message carries the rank and its traceback."""


class WorkerDied(RuntimeError):
    """A pool worker process exited (crash or signal) during a call."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """A worker's loop: import torch once, then run jobs until told to stop (None) or the pipe closes."""
    import torch

    torch.set_num_threads(1)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            os._exit(0)    # don't wait for threads a test left behind (stores, gloo): the pool is done
        fn, rank, world_size, env, args = job
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            result = ("ok", fn(rank, world_size, *args), _left_initialized())
        except BaseException as error:   # reported to the parent with the rank's traceback
            result = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}", True)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            conn.send(result)
        except Exception as error:   # an unpicklable result: report it instead
            conn.send(("error", f"result of rank {rank} could not be sent back: {error}", True))


def _left_initialized() -> bool:
    """Whether the job left spmd or torch.distributed initialized (the worker is then replaced)."""
    import sys

    spmd = sys.modules.get("spmd")
    tdist = sys.modules.get("torch.distributed")
    return bool((spmd is not None and spmd.is_initialized()) or
                (tdist is not None and tdist.is_available() and tdist.is_initialized()))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="spmd-test-rank")
        self.process.start()
        child.close()
        self.pid: int | None = None

    def wait_ready(self, deadline: float) -> None:
        if self.pid is not None:
            return
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("a pool worker did not start in time")
        _, self.pid = self.conn.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def ask_to_stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass

    def join_or_kill(self) -> None:
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


class ProcPool:
    """Rank processes reused across tests; see the module docstring."""

    def __init__(self, max_workers: int = 4) -> None:
        self.max_workers = max_workers
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []

    def _ensure(self, count: int) -> list[_Worker]:
        if count > self.max_workers:
            raise ValueError(f"ProcPool: {count} ranks requested, the pool has at most {self.max_workers}")
        while len(self._workers) < count:
            self._workers.append(_Worker(self._ctx))
        deadline = time.monotonic() + _SPAWN_TIMEOUT
        for worker in self._workers[:count]:
            worker.wait_ready(deadline)
        return self._workers[:count]

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self._ctx)

    def run(self, fn: Callable[..., Any], world_size: int, timeout: float, args: tuple = (),
            env: dict[str, str] | None = None, may_die: frozenset[int] = frozenset()) -> list[Any]:
        """Run fn(rank, world_size, *args) on `world_size` workers; per-rank results (None for a rank in
        `may_die` that died). Raises WorkerFailure, WorkerDied or TimeoutError, after replacing the workers."""
        workers = self._ensure(world_size)
        base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}
        for rank, worker in enumerate(workers):
            worker.conn.send((fn, rank, world_size, {**base_env, **(env or {}), "RANK": str(rank)}, args))
        results: dict[int, Any] = {}
        errors: list[str] = []
        dirty: set[int] = set()
        deadline = time.monotonic() + timeout
        pending = {rank: worker for rank, worker in enumerate(workers)}
        while pending:
            waitables = [w.conn for w in pending.values()] + [w.process.sentinel for w in pending.values()]
            ready = multiprocessing.connection.wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank, worker in list(pending.items()):
                if worker.conn in ready or worker.conn.poll():
                    try:
                        status, value, left_initialized = worker.conn.recv()
                    except (EOFError, OSError):
                        status, value, left_initialized = "died", None, True
                elif worker.process.sentinel in ready:
                    status, value, left_initialized = "died", None, True
                else:
                    continue
                del pending[rank]
                if status == "ok":
                    results[rank] = value
                elif status == "died":
                    results[rank] = None
                    if rank not in may_die:
                        errors.append(f"rank {rank}: worker process died (exit code {worker.process.exitcode})")
                else:
                    errors.append(f"rank {rank}: {value}")
                if status != "ok" or left_initialized:
                    dirty.add(rank)
        timed_out = sorted(pending)
        for rank in sorted(dirty | set(timed_out)):
            self._replace(rank)
        if timed_out:
            raise TimeoutError(f"ProcPool.run({fn.__name__}): ranks {timed_out} still running after {timeout:.0f}s"
                               + ("".join(f"\n{e}" for e in errors)))
        if errors:
            died = all("worker process died" in e for e in errors)
            raise (WorkerDied if died else WorkerFailure)(f"ProcPool.run({fn.__name__}) failed:\n" + "\n".join(errors))
        return [results[rank] for rank in range(world_size)]

    def shutdown(self) -> None:
        for worker in self._workers:
            worker.ask_to_stop()
        for worker in self._workers:
            worker.join_or_kill()
        self._workers.clear()


def kill_self() -> None:
    """SIGKILL the calling process (a test's way to make a rank die without any cleanup)."""
    os.kill(os.getpid(), signal.SIGKILL)
